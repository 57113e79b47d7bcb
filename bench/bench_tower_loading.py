"""Peak memory of loading a vision tower: the growth of a process's peak RSS while
`VisionTower.load` reads a Gemma 3 SigLIP tower (random weights, exo's module layout) from a
bfloat16 safetensors file, over the tower's float32 bytes, with exo's loader and, for
comparison, the earlier one (every tensor read into a float32 copy, then
`load_state_dict`, into randomly initialized modules). Each measurement is a fresh process
(the peak RSS only grows); the loaders alternate.

Usage: PYTHONPATH=src python bench/bench_tower_loading.py [--sizes small large] [--rounds 2]
       [--work-dir DIR]

Sizes: small (hidden 768, 8 layers, 224-pixel images: 65M parameters), large (hidden 1152,
12 layers, 896-pixel images: 204M, Gemma 3's tower has 27 such layers).
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SIZES = {
    "small": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 8,
              "num_attention_heads": 12, "image_size": 224, "patch_size": 14},
    "large": {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 12,
              "num_attention_heads": 16, "image_size": 896, "patch_size": 14},
}  # fmt: skip


def _config(size: str) -> Any:
    from transformers import Gemma3Config

    vision = SIZES[size]
    tokens = (vision["image_size"] // vision["patch_size"] // 4) ** 2
    return Gemma3Config(
        text_config={
            "vocab_size": 300, "hidden_size": 640, "intermediate_size": 96,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 1,
            "head_dim": 16,
        },
        vision_config=vision, mm_tokens_per_image=tokens,
    )  # fmt: skip


def _earlier_loader(module: Any, model_dir: Path, prefixes: tuple[str, ...]) -> None:
    """The loader before 2026-12-06: all tensors as float32 copies, then one
    `load_state_dict`."""
    from safetensors import safe_open

    expected = set(module.state_dict())
    found = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118
                local = name.removeprefix("model.")
                if local.startswith(prefixes) and local in expected:
                    found[local] = handle.get_tensor(name).float()
    module.load_state_dict(found)


def _child(mode: str, size: str, directory: Path) -> None:
    """One measurement in this process: save, or load with `mode` and print the growth."""
    import torch

    import exo.worker.engines.torch.model.vision_parts as vision_parts
    from exo.worker.engines.torch.model.gemma3_vision import Gemma3VisionEncoder

    config = _config(size)
    if mode == "save":
        from safetensors.torch import save_file

        tower = Gemma3VisionEncoder.from_config(config)
        state = {k: v.to(torch.bfloat16).contiguous() for k, v in tower.state_dict().items()}
        save_file(state, str(directory / "model.safetensors"))
        return
    if mode == "earlier":
        vision_parts.load_vision_tensors = _earlier_loader  # type: ignore[assignment]
        vision_parts.VisionTower.load = classmethod(  # type: ignore[method-assign,assignment]
            lambda cls, model_dir, config: _load_initialized(cls, model_dir, config)
        )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tower = Gemma3VisionEncoder.load(directory, config)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    size_bytes = sum(t.numel() * t.element_size() for t in tower.state_dict().values())
    growth = (after - before) * 1024
    print(f"{size_bytes} {growth}")


def _load_initialized(cls: Any, model_dir: Path, config: Any) -> Any:
    import exo.worker.engines.torch.model.vision_parts as vision_parts

    tower = cls.from_config(config)
    vision_parts.load_vision_tensors(tower, model_dir, cls.checkpoint_prefixes)
    return tower


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, size, directory = args.child
        _child(mode, size, Path(directory))
        return
    root = args.work_dir or Path(tempfile.mkdtemp(prefix="exo-tower-loading-"))
    for size in args.sizes:
        directory = root / size
        directory.mkdir(parents=True, exist_ok=True)
        run = [sys.executable, __file__, "--child"]
        subprocess.run([*run, "save", size, str(directory)], check=True)
        for round_index in range(args.rounds):
            for mode in ("exo", "earlier"):
                output = subprocess.run(
                    [*run, mode, size, str(directory)], check=True, capture_output=True, text=True
                ).stdout.split()
                tower, growth = int(output[-2]), int(output[-1])
                print(
                    f"{size:5s} round {round_index + 1} {mode:7s}: tower {tower / 1e6:6.0f} MB "
                    f"float32, peak RSS growth {growth / 1e6:6.0f} MB = {growth / tower:.2f}x",
                    flush=True,
                )


if __name__ == "__main__":
    main()
