"""Model components (conf group ``model``).

``gpt.py`` registers the GPT presets ``gpt-nano``, ``gpt-mini``, ``gpt2-small``,
``gpt2-medium`` and ``gpt-1b``: one ``GPTConfig`` schema, sizes in ``conf/model/<name>.yaml``.
``build(cfg, vocab_size=None)`` returns the module; a data source that knows its vocabulary
passes ``vocab_size`` to override the YAML default. ``gpt_loss(model, (x, y))`` is the
training objective.

``hf.py`` registers ``hf``: any Hugging Face causal LM, from a ``config.json``
(``model.config``) or a ``save_pretrained`` folder (``model.pretrained``), trained with
``causal_lm_loss``. Each component is a ``ModelComponent`` (``_base.py``): it names the loss
the loop trains with and the weights to load once the stage has set the model up.
"""
