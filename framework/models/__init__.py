"""Model components (conf group ``model``): ``gpt.py`` registers the GPT presets (one ``GPTConfig``
schema, sizes in ``conf/model/<name>.yaml``), ``hf.py`` registers ``hf`` (any Hugging Face causal
LM from local files). Each is a ``ModelComponent`` (``_base.py``): ``build(cfg, vocab_size=None)``,
the loss the loop trains with, and the weights to load once the stage has set the model up."""
