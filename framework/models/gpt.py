"""A nanoGPT-style GPT with einops: pre-LN ``Block``s (the unit ZeRO-3 gathers and checkpointing wraps), causal
``scaled_dot_product_attention``, learned positions, a 4x GELU MLP, optional biases, dropout and weight tying.
The presets live in ``conf/model/<name>.yaml`` (every ``gpt*.yaml`` there is one); ``preset(name)`` reads one."""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import yaml
from einops import rearrange
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from framework.core import files
from framework.core.errors import ConfigError
from framework.core.paths import conf_dir
from framework.models._base import ModelComponent, name_seed, next_token_loss


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int
    context: int            # maximum sequence length (size of the position table)
    n_layer: int
    n_head: int
    d_model: int
    dropout: float = 0.0
    bias: bool              # biases in Linear and LayerNorm layers (GPT-2 has them)
    tie_weights: bool = True  # output projection reuses the token embedding matrix
    activation_checkpointing: bool = False  # recompute each Block in backward to save memory

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context", "n_layer", "n_head", "d_model"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ConfigError(f"model.d_model ({self.d_model}) must be divisible by model.n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = rearrange(self.qkv(x), "b t (three h e) -> three b h t e", three=3, h=self.n_head)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_drop(self.proj(rearrange(y, "b h t e -> b t (h e)")))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-LN transformer layer: the unit of ZeRO-3 gathering and of checkpointing."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Embedding):
    """``nn.Embedding`` that is also the tied output projection (``wte(x, unembed=True)``): one tensor under one
    name, used only in its own forward, where ZeRO-3's hooks see every use. No init on meta
    (``GPT.init_parameter`` writes it later; meta ``normal_`` imports ``torch._dynamo``, over a second)."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, x: Tensor, unembed: bool = False) -> Tensor:
        return F.linear(x, self.weight) if unembed else super().forward(x)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = Embedding(cfg.context, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = None if cfg.tie_weights else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.init_seed = torch.initial_seed()  # see init_parameter
        if not any(p.is_meta for p in self.parameters()):
            with torch.no_grad():
                for name, p in self.named_parameters():
                    self.init_parameter(name, p)

    def get_input_embeddings(self) -> Embedding:
        """The token embedding (as Hugging Face models name it): its rows are the vocabulary."""
        return self.wte

    def init_parameter(self, name: str, t: Tensor) -> None:
        """nanoGPT's init of parameter ``name`` into ``t``, from a generator seeded by (initial seed, name): a
        stage materialising one parameter at a time gets the values of a model built whole."""
        if name.endswith(".bias"):
            t.zero_()
        elif ".ln" in f".{name}":
            t.fill_(1.0)  # LayerNorm weight
        else:
            # A CPU generator whatever t's device: the device's draws differ, and the values must not.
            gen = torch.Generator().manual_seed(name_seed(self.init_seed, name))
            # GPT-2 scales residual projections by 1/sqrt(2 * n_layer): the stream's variance stays flat.

            residual = name.endswith(("attn.proj.weight", "mlp.proj.weight"))
            std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if residual else 0.02
            host = t if t.device.type == "cpu" else torch.empty(t.shape, dtype=t.dtype, device="cpu")
            host.normal_(0.0, std, generator=gen)
            if host is not t:
                t.copy_(host)

    def forward(self, idx: Tensor) -> Tensor:
        """Token ids [B, T] -> fp32 logits [B, T, vocab]. Ids outside [0, vocab_size) are refused on the host and
        other non-CUDA devices; on CUDA they are not checked (reading them would make the host wait for the device
        every step), and the embedding's device-side assert is what an out-of-range id gives there."""
        t = idx.shape[1]
        if t > self.cfg.context:
            raise ValueError(f"sequence length {t} exceeds the model context {self.cfg.context}")
        if idx.numel() and idx.device.type not in ("cuda", "meta"):
            self._check_ids(idx)
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        # Checkpointing only pays off when a backward pass will follow.
        recompute = self.cfg.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        x = self.ln_f(x)
        logits = self.wte(x, unembed=True) if self.lm_head is None else self.lm_head(x)
        return logits.float()   # the loss's softmax over the vocabulary wants fp32

    def _check_ids(self, idx: Tensor) -> None:
        # host sync: not on CUDA (forward skips it there); on the host this reads memory already there
        low, high = (int(v) for v in torch.aminmax(idx))
        if low < 0:   # (no vocab_size helps: an ignore/padding value such as -100 belongs in the targets alone)
            raise ValueError(f"token id {low} is outside the model's vocabulary [0, {self.cfg.vocab_size}): input ids "
                             f"run from 0 to vocab_size-1; an ignore value such as -100 goes in the targets only")
        if high >= self.cfg.vocab_size:
            raise ValueError(f"token id {high} is outside the model's vocabulary [0, {self.cfg.vocab_size}): give ids "
                             f"below vocab_size, or build the model with a vocab_size above {high}")

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` [B, T]; temperature 0 is greedy."""
        # A negative temperature would favour the least likely tokens, silently; top_k 0 keeps no token.
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"generate: temperature must be a finite number >= 0 (0 is greedy), got {temperature!r}")
        if top_k is not None and not (isinstance(top_k, numbers.Integral) and top_k >= 1):
            raise ValueError(f"generate: top_k must be a whole number >= 1 or None (no cut), got {top_k!r}")
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.cfg.context:])[:, -1, :]
            if temperature == 0.0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


def gpt_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """Mean next-token cross-entropy of one micro batch ``(x, y)``, both int64 [B, T]."""
    x, y = batch
    return next_token_loss(model(x), y)


def build(cfg: GPTConfig, vocab_size: int | None = None) -> GPT:
    """Build on the current default device; ``vocab_size`` (from the data source) overrides the YAML."""
    return GPT(cfg if vocab_size in (None, cfg.vocab_size) else dataclasses.replace(cfg, vocab_size=vocab_size))


def preset(name: str) -> GPTConfig:
    """The config ``conf/model/<name>.yaml`` holds, a bad file refused in one line naming it. Read when asked for,
    never at import: a bad preset must not break the runs of every other model."""
    path = conf_dir() / "model" / f"{name}.yaml"
    try:
        node = files.parse_yaml(path.read_text())
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read model preset {name!r}: {' '.join(str(e).split())}") from None
    fields = [f.name for f in dataclasses.fields(GPTConfig)]
    if not isinstance(node, dict):
        raise ConfigError(f"{path}: model preset {name!r} is not a mapping of GPT keys ({', '.join(fields)})")
    unknown = sorted(set(node) - set(fields))
    if unknown:
        raise ConfigError(f"{path}: unknown key {unknown[0]!r} in model preset {name!r}; its keys are "
                          f"{', '.join(fields)}")
    try:
        return GPTConfig(**node)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except TypeError as e:   # a required key missing
        raise ConfigError(f"{path}: model preset {name!r}: {e}") from None


# Each preset by its file name alone (the values are the run's composed node): nothing read at import.
COMPONENTS: dict[str, ModelComponent] = {path.stem: ModelComponent(config=GPTConfig, build=build, loss=gpt_loss,
                                                                     hidden_size=lambda cfg: cfg.d_model)
                                          for path in sorted((conf_dir() / "model").glob("gpt*.yaml"))}
