"""Synthetic data: a random first-order Markov chain with a known optimal loss.

``chain_seed`` (not the run seed) fixes the chain; each row of its transition matrix P is drawn from
Dirichlet(concentration). Sequences start from the stationary distribution pi, so the best prediction's
expected loss at every position is the entropy rate H = -sum_i pi_i sum_j P_ij log P_ij nats/token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from framework.data._base import CHAIN_STREAM, DataSource
from framework.core.errors import ConfigError
from framework.core.registry import Component


MAX_VOCAB = 4096


@dataclass(frozen=True, kw_only=True)
class SyntheticConfig:
    vocab_size: int = 64
    # Dirichlet alpha of each row: 0.05 over 64 symbols gives H = 1.902 nats (context-free: 4.04, uniform:
    # 4.16); gpt-nano's default recipe ends ~0.035 nats above it.
    concentration: float = 0.05
    chain_seed: int = 0     # which chain; independent of the run seed

    def __post_init__(self) -> None:
        if self.vocab_size < 2:
            raise ConfigError(f"data.vocab_size must be >= 2, got {self.vocab_size}")
        # The chain is dense: ~48 V^2 bytes and an O(V^3) solve (0.8 GB and ~15 s at 4096).
        if self.vocab_size > MAX_VOCAB:
            raise ConfigError(f"data.vocab_size must be <= {MAX_VOCAB} for synthetic data, got {self.vocab_size} "
                              f"(its transition matrix is dense: ~48 V^2 bytes); use data=tokens for a larger vocabulary")
        if not self.concentration > 0:
            raise ConfigError(f"data.concentration must be > 0, got {self.concentration}")
        if self.chain_seed < 0:   # numpy's seed sequence takes none
            raise ConfigError(f"data.chain_seed must be >= 0, got {self.chain_seed}; give 0 or more")


def stationary(p: np.ndarray, a: np.ndarray, cfg: SyntheticConfig) -> np.ndarray:
    """pi of ``pi P = pi``, or a ConfigError where a small concentration splits the chain into parts that never
    reach each other (no unique pi, so no floor): the answer is checked."""
    try:
        pi = np.linalg.solve(a, np.eye(len(p))[-1])
    except np.linalg.LinAlgError:
        pi = None
    if pi is None or not np.isfinite(pi).all() or pi.min() < -1e-9 or np.abs(pi @ p - pi).max() > 1e-9:
        raise ConfigError(f"data.concentration={cfg.concentration} gives a chain (vocab_size={cfg.vocab_size}, "
                          f"chain_seed={cfg.chain_seed}) whose states split into parts that never reach each other, "
                          f"so it has no unique stationary distribution or entropy floor; raise data.concentration "
                          f"(0.01 or more; the default is 0.05) or choose another data.chain_seed")
    pi = np.clip(pi, 0.0, None)
    return pi / pi.sum()


class SyntheticSource(DataSource):
    def __init__(self, cfg: SyntheticConfig, *, seed: int, context: int) -> None:
        self.cfg, self.seed, self.context = cfg, seed, context
        self.vocab_size, self.val_key = cfg.vocab_size, (cfg.chain_seed,)
        v = cfg.vocab_size
        rng = np.random.default_rng([CHAIN_STREAM, cfg.chain_seed])
        p = rng.dirichlet(np.full(v, cfg.concentration), size=v)            # float64 [V, V]
        # Solve pi (P - I) = 0 with one equation replaced by sum(pi) = 1.
        a = p.T - np.eye(v)
        a[-1] = 1.0
        pi = stationary(p, a, cfg)
        plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
        self.entropy_rate = float(-(pi * plogp.sum(axis=1)).sum())
        self.unigram_entropy = float(-(pi[pi > 0] * np.log(pi[pi > 0])).sum())
        self.transition = torch.from_numpy(p)                                # exact, for tests
        self.stationary = torch.from_numpy(pi)
        # Inverse-CDF tables; the last entry is forced to 1 so u in [0, 1) always lands.
        self._cdf = torch.from_numpy(np.cumsum(p, axis=1))
        self._cdf[:, -1] = 1.0
        self._pi_cdf = torch.from_numpy(np.cumsum(pi))
        self._pi_cdf[-1] = 1.0

    def _draw(self, split: str, n: int, gen: torch.Generator, rows: Tensor) -> Tensor:
        # Every rank draws the whole batch's uniforms and simulates its rows: each token an inverse CDF.

        u = torch.rand(n, self.context + 1, generator=gen, dtype=torch.float64, device="cpu")[rows]
        seqs = torch.empty(u.shape, dtype=torch.int64, device="cpu")
        state = torch.searchsorted(self._pi_cdf, u[:, 0].contiguous(), right=True)
        seqs[:, 0] = state
        for t in range(1, u.shape[1]):
            state = torch.searchsorted(self._cdf[state], u[:, t:t + 1].contiguous(), right=True).squeeze(1)
            seqs[:, t] = state
        return seqs

    def describe(self) -> dict:
        return {"source": "synthetic", "vocab_size": self.vocab_size,
                "concentration": self.cfg.concentration, "chain_seed": self.cfg.chain_seed,
                "entropy_rate": self.entropy_rate,
                "entropy_floor": self.entropy_rate,          # see the module docstring
                "unigram_entropy": self.unigram_entropy,     # loss of a context-free model
                "uniform_loss": math.log(self.vocab_size)}


COMPONENT = Component(config=SyntheticConfig, build=SyntheticSource)
