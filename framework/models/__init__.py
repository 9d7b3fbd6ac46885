"""Model components (conf group ``model``): ``gpt.py`` registers the GPT presets (sizes in
``conf/model/<name>.yaml``), ``hf.py`` registers ``hf`` (any Hugging Face causal LM from local files)."""
