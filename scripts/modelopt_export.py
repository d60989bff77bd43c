"""The ModelOpt step the fixture scripts share (scripts/make_*_fixture.py): NVFP4 for the
routed experts only, calibrated on seeded random tokens, exported as a Hugging Face
checkpoint. Imported by those scripts from this folder; needs nvidia-modelopt."""

from __future__ import annotations

import shutil
from pathlib import Path

import modelopt.torch.quantization as mtq
import torch
from modelopt.torch.export import export_hf_checkpoint

# An E2M1 code's value (bit 3 the sign): what the scripts' own checks decode the export
# with, independently of the project's decoder.
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def quantize_and_export(model: torch.nn.Module, vocab_size: int, seed: int, out: Path):
    """Quantize `model`'s experts (NVFP4_EXPERTS_ONLY_CFG; the input scales from four
    batches of 4 x 32 random tokens drawn with `seed`), export it to `out` (replaced),
    keep only what the tests read (no generation config), files mode 0644. Returns the
    quantized model."""
    gen = torch.Generator().manual_seed(seed)
    calib = [torch.randint(0, vocab_size, (4, 32), generator=gen) for _ in range(4)]

    def forward_loop(m):
        with torch.no_grad():
            for ids in calib:
                m(input_ids=ids)

    model = mtq.quantize(model, mtq.NVFP4_EXPERTS_ONLY_CFG, forward_loop)
    if out.exists():
        shutil.rmtree(out)
    export_hf_checkpoint(model, export_dir=str(out))
    (out / "generation_config.json").unlink(missing_ok=True)
    for path in out.iterdir():
        path.chmod(0o644)
    return model
