"""Our estimator tables against DeepSpeed's own estimator functions, row by row (needs DeepSpeed).

    PYTHONPATH=$PWD:$PWD/.bench-venv/ds-site DS_ACCELERATOR=cpu python -m bench.estimate_ds

For a grid of (P, L, GPUs per node, nodes) and for the _all_live forms on real (not meta) models,
compares the bytes DeepSpeed's ``estimate_zero{2,3}_model_states_mem_needs`` return with ours
(``framework.memory.tables``): every row must be equal, not merely round to the same GiB. DeepSpeed is a
benchmark peer only; the framework does not import it.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.estimate_ds", description=__doc__.split("\n\n")[0])
    ap.parse_args(argv)
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    except Exception as e:  # ImportError, or DeepSpeed failing to set up its accelerator
        why = (str(e).strip().splitlines() or [""])[0][:200]
        ap.exit(2, f"needs DeepSpeed: `import deepspeed` failed in {sys.executable} ({type(e).__name__}: {why}); "
                   f"put it on PYTHONPATH as the module docstring shows\n")

    from framework.memory.tables import count_module, zero2_rows, zero3_rows
    from framework.models.gpt import GPT, preset

    cases = rows = 0
    grid = itertools.product((2851e6, 1.417e9, 124_475_904, 7e9, 804_096), (32e6, 103_022_592, 65_536),
                             (1, 2, 8), (1, 2, 3, 4, 5, 7))
    for P, L, G, N in grid:
        ours2 = zero2_rows(P, G, N)
        for row, off in zip(ours2, (True, False)):
            cpu, gpu = estimate_zero2_model_states_mem_needs(P, G, N, cpu_offload=off)
            assert (row.cpu, row.gpu) == (cpu, gpu), (P, G, N, off, row, cpu, gpu)
            rows += 1
        ours3 = iter(zero3_rows(P, L, G, N))
        for off, par in ((True, True), (True, False), (False, False)):
            for zi in (True, False):
                row = next(ours3)
                cpu, gpu, _ = estimate_zero3_model_states_mem_needs(P, L, G, N, cpu_offload=off,
                                                                    cpu_offload_params=par, zero_init=zi)
                assert (row.cpu, row.gpu) == (cpu, gpu), (P, L, G, N, off, par, zi, row, cpu, gpu)
                rows += 1
        cases += 1
    # _all_live: DeepSpeed counts a real model by data_ptr; ours counts the same model on meta by identity.
    for name in ("gpt-nano", "gpt-mini"):
        real = GPT(preset(name))
        with torch.device("meta"):
            meta = GPT(preset(name))
        ds_p, ds_l = model_to_params(real)
        c = count_module(meta)
        assert (c.params, c.largest_layer) == (ds_p, ds_l), (name, c, ds_p, ds_l)
        ds_meta = model_to_params(meta)[0]
        print(f"{name}: P={c.params:,} L={c.largest_layer:,} (DeepSpeed on the real model: same; "
              f"DeepSpeed on the meta model: P={ds_meta:,})")
    print(f"{cases} (P, L, G, N) cases, {rows} rows: every row equal to DeepSpeed's bytes")


if __name__ == "__main__":
    main()
