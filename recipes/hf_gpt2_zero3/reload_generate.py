"""After training: export as a Hugging Face folder, reload with from_pretrained, check, generate.

    python recipes/hf_gpt2_zero3/reload_generate.py OUT_DIR      # (the recipe runs this itself)

The training job (the guide's JSON sets stage3_gather_16bit_weights_on_model_save) wrote the
consolidated weights to <job>/model_16bit/ as safetensors; with the model's config.json beside
them the folder is a save_pretrained folder. GPT2LMHeadModel.from_pretrained loads it, its loss
on the job's validation batches must equal the loss the job reported, and it generates 16 tokens.
Writes OUT_DIR/reload.json.
"""
from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from framework.data import synthetic


def main(out: Path) -> None:
    job = next(p.parent for p in sorted(out.glob("run*-job*/summary.json")))
    summary = json.loads((job / "summary.json").read_text())
    cfg = summary["config"]
    hf = out / "hf_export"
    export = job / "model_16bit"
    if any(export.glob("*.safetensors")):
        shutil.copytree(export, hf, dirs_exist_ok=True)
        if not (hf / "config.json").is_file():   # weights only: add the model's config (save_pretrained's other half)
            shutil.copy(Path(cfg["model"]["config"]), hf / "config.json")
    else:
        raise SystemExit(f"{job} holds no saved weights: set stage3_gather_16bit_weights_on_model_save in "
                         f"ds_config.json")
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()

    # The job's validation batches, as one rank of world 1 sees them (the same rows as every rank's together).
    data_cfg = {k: v for k, v in cfg["data"].items() if k != "name"}
    src = synthetic.SyntheticSource(synthetic.SyntheticConfig(**data_cfg), seed=cfg["seed"], context=cfg["model"]["context"])
    batches = src.val_batches(cfg["train"]["eval_batches"], batch=cfg["train"]["micro_batch"] * cfg["train"]["grad_accum"]
                              * summary["world"],
                              rank=0, world=1)
    with torch.no_grad():
        losses = [torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()).item()
                  for x, y in batches]
        val = sum(losses) / len(losses)
        prompt = batches[0][0][:1, :8]
        # eos_token_id=None: the config's eos (0) is an ordinary symbol of the chain, not an end to stop at
        generated = model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None)
    new = generated[0, prompt.shape[1]:].tolist()
    # null where either loss is not finite (summary.json's null: the job diverged), which fails the check
    job_val = summary["val_loss"]
    val = val if math.isfinite(val) else None
    result = {"export": str(hf), "val_loss_reloaded": val, "val_loss_job": job_val,
              "val_loss_abs_diff": None if val is None or job_val is None else abs(val - job_val),
              "prompt": prompt[0].tolist(), "generated": new, "generated_tokens": len(new)}
    (out / "reload.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"from_pretrained({hf}): val loss {_loss(val)} vs the job's {_loss(job_val)}; generated {new}")


def _loss(v: float | None) -> str:
    return "not finite" if v is None else f"{v:.6f}"


if __name__ == "__main__":
    main(Path(sys.argv[1]))
