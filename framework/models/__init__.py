"""Model components (conf group ``model``): ``gpt.py`` registers the GPT presets (sizes in
``conf/model/<name>.yaml``), ``hf.py`` registers ``hf`` (any Hugging Face causal LM from local files)."""

UNKNOWN_HINT = ("a Hugging Face model is model=hf model.config=path/to/config.json (or its folder; local files: "
                "nothing is downloaded)")
