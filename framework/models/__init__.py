"""Model components (conf group ``model``): ``gpt.py`` registers the GPT presets (each
``conf/model/gpt*.yaml``, by its name), ``hf.py`` registers ``hf`` (any Hugging Face causal LM from local files).
Another model is a module here defining ``COMPONENT = ModelComponent(config=..., build=..., loss=...)``
(``_base.py``) whose config has a ``context`` field, plus its YAML file: ``check_entry`` refuses any other."""
from framework.core.errors import ConfigError
from framework.core.registry import require_fields
from framework.models._base import ModelComponent



def UNKNOWN_HINT(name: str) -> str:  # noqa: N802 (the registry's name for it)
    """What an unknown model's line adds: how a Hugging Face model is named, and for a YAML file's path (which
    training takes only by name) how to make it one of ours."""
    own = ("; a GPT model YAML of your own: copy it into conf/model/ as gpt-NAME.yaml (a GPT model there is a file "
           "named gpt*.yaml) and give model=gpt-NAME" if name.endswith((".yaml", ".yml")) else "")
    return ("a Hugging Face model is model=hf model.config=path/to/config.json (or its folder; local files: nothing "
            "is downloaded)" + own)


def check_entry(module_name: str, name: str, component) -> None:
    """What training needs of a model entry beyond a registry ``Component``: its loss, and the sequence length
    it feeds the model (``model.context``)."""
    if not isinstance(component, ModelComponent):
        raise ConfigError(f"model {name!r} ({module_name}) is a {type(component).__name__}, not a ModelComponent, "
                          f"so training has no loss for it; define it as ModelComponent(config=..., build=..., "
                          f"loss=loss_fn) (from framework.models._base import ModelComponent)")
    require_fields("model", module_name, name, component.config, (("context", "a field context: int"),),
                   "the sequence length training feeds the model")
