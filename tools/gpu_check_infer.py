"""Check ``ucp infer --device cuda`` on a GPU: both read paths, greedy tokens against transformers on the GPU.

Prepared for a short session on a lent GPU machine (about a minute on an H200; the model is built on
the GPU, saved with ``save_pretrained``, and streamed back from disk)::

    python tools/gpu_check_infer.py                    # ~155M-parameter fp32 Llama, 512 MiB budget
    python tools/gpu_check_infer.py --json out.json    # also write the summary there
    python tools/gpu_check_infer.py --device cpu --layers 2 --hidden 128 --vocab 512   # a dry run of the script

For each read path (``staged``: O_DIRECT into pinned host buffers, async copies on a copy stream;
``gds``: KvikIO into device buffers, when kvikio imports) the weight files are evicted from the page
cache and ``infer`` generates greedily with whole layers streamed (``pin_layers=False``). Correct (exit
0) when every path's tokens equal ``LlamaForCausalLM.generate``'s on the same device and the prefill
logits are within ``--rtol`` of transformers' (TF32 off on both sides). Prints one JSON object
(tokens/s, time to first token, read GB/s, the share of reads hidden, pinned and staging bytes against
the budget, the path's reason), then a markdown table. Without CUDA (and without ``--device cpu``) it
exits 2 with a message saying so.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install needed

import torch  # noqa: E402

from aio.sizes import parse_size  # noqa: E402
from tools.argtypes import positive_int  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a dry run of this script)")
    p.add_argument("--layers", type=positive_int, default=8)
    p.add_argument("--hidden", type=positive_int, default=1024)
    p.add_argument("--intermediate", type=positive_int, default=2816)
    p.add_argument("--vocab", type=positive_int, default=32000)
    p.add_argument("--heads", type=positive_int, default=16)
    p.add_argument("--kv-heads", type=positive_int, default=4)
    p.add_argument("--batch", type=positive_int, default=4)
    p.add_argument("--prompt-len", type=positive_int, default=16)
    p.add_argument("--new-tokens", type=positive_int, default=32)
    p.add_argument("--budget", default="512MiB", help="weight memory budget on the device")
    p.add_argument("--rtol", type=float, default=1e-4, help="prefill logits: max |ours - hf| / max |hf|")
    p.add_argument("--dir", type=Path, default=None, help="where the weights go (default: a temporary directory)")
    p.add_argument("--json", type=Path, default=None, help="also write the summary here")
    return p.parse_args(argv)


def build(a: argparse.Namespace, device: torch.device) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        max_position_embeddings=max(256, a.prompt_len + a.new_tokens),
        tie_word_embeddings=False,
    )
    with torch.device(device):
        model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # transformers initialises norms to ones: randomise them so a misplaced norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model


def evict(path: Path) -> bool:
    from aio.tune import evict_file

    return all([evict_file(f) for f in sorted(path.glob("*.safetensors"))])


def check_path(a: argparse.Namespace, path: Path, read_path: str, prompts: list[list[int]], hf: dict) -> dict:
    from training.inference.api import infer
    from training.inference.config import load_model
    from training.inference.executor import Executor
    from training.inference.generate import generate
    from training.inference.sources import open_weights

    budget = parse_size(a.budget, what="--budget")
    dropped = evict(path)
    t0 = time.perf_counter()
    res = infer(
        path,
        prompts,
        max_new_tokens=a.new_tokens,
        memory_budget=budget,
        pin_layers=False,
        device=a.device,
        read_path=read_path,
    )
    wall = time.perf_counter() - t0
    model, source = load_model(open_weights(path))
    with Executor(model, source, budget, pin_layers=False, device=a.device, read_path=read_path) as ex:
        logits = generate(ex, prompts, 1, keep_logits=True).logits[0]
    rel = float((logits - hf["logits"]).abs().max() / hf["logits"].abs().max())
    m = res.metrics
    same = res.tokens == hf["tokens"]
    first_diff = next(
        ([i, j] for i, (x, y) in enumerate(zip(res.tokens, hf["tokens"])) for j in range(len(x)) if x[j] != y[j]),
        None,
    )
    return {
        "read_path": m.read_path,
        "reason": m.read_path_reason,
        "device": m.device,
        "tokens_equal_transformers": same,
        "first_differing_token": first_diff,
        "prefill_logits_rel_err": rel,
        "logits_ok": rel <= a.rtol,
        "decode_tokens_per_s": round(m.decode_tokens_per_s, 1),
        "time_to_first_token_s": round(m.time_to_first_token_s, 4),
        "read_gb_per_s": round(m.read_gb_per_s, 3),
        "read_hidden_fraction": round(m.read_hidden_fraction, 3),
        "bytes_read_per_token": int(m.bytes_read_per_token),
        "budget_bytes": m.budget_bytes,
        "resident_bytes": m.resident_bytes,
        "ring_bytes": m.ring_bytes,
        "pinned_bytes": m.pinned_bytes,
        "staging_bytes": m.staging_bytes,
        "prefetch_depth": m.prefetch_depth,
        "page_cache_growth_bytes": m.page_cache_growth_bytes,
        "cache_evicted_before": dropped,
        "engine": m.engine,
        "wall_s": round(wall, 2),
    }


def markdown(summary: dict) -> str:
    rows = [
        "| read path | tokens = hf | logits rel err | decode tok/s | TTFT s | read GB/s | hidden | pinned MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["paths"].values():
        if "skipped" in r:
            rows.append(f"| {r['read_path']} | skipped: {r['skipped']} | | | | | | |")
            continue
        rows.append(
            f"| {r['read_path']} | {r['tokens_equal_transformers']} | {r['prefill_logits_rel_err']:.2e} | "
            f"{r['decode_tokens_per_s']} | {r['time_to_first_token_s']} | {r['read_gb_per_s']} | "
            f"{r['read_hidden_fraction']} | {r['pinned_bytes'] / 2**20:.1f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            f"gpu_check_infer: device {a.device!r} asked for, but CUDA is not usable here (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda}); nothing to check (run it on a GPU machine, or --device cpu for a dry run)",
            file=sys.stderr,
        )
        return 2
    try:
        import transformers
    except ImportError as exc:
        print(f"gpu_check_infer: transformers is needed for the reference ({exc})", file=sys.stderr)
        return 2
    import gds

    torch.backends.cuda.matmul.allow_tf32 = False  # both sides in true fp32
    torch.backends.cudnn.allow_tf32 = False
    t0 = time.perf_counter()
    caps = gds.capabilities()
    summary: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kvikio": caps.kvikio_version if caps.kvikio_importable else f"not importable ({caps.kvikio_error})",
        "cufile_usable": caps.cufile_usable,
    }
    with tempfile.TemporaryDirectory(prefix="ucp-gpu-infer-", dir=a.dir) as tmp:
        path = Path(tmp) / "llama"
        model = build(a, device)
        model.save_pretrained(path, safe_serialization=True)
        summary["params"] = sum(p.numel() for p in model.parameters())
        summary["weight_bytes"] = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        g = torch.Generator().manual_seed(1)
        prompts = torch.randint(0, a.vocab, (a.batch, a.prompt_len), generator=g)
        with torch.no_grad():
            ids = prompts.to(device)
            hf_logits = model(ids).logits.float().cpu()
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.new_tokens, do_sample=False, pad_token_id=0
            )
        hf = {"tokens": out[:, a.prompt_len :].tolist(), "logits": hf_logits}
        del model, out
        if device.type == "cuda":
            torch.cuda.empty_cache()
        paths = ["staged", "gds"] if device.type == "cuda" else ["cpu", "staged"]
        summary["paths"] = {}
        for rp in paths:
            if rp == "gds" and not caps.kvikio_importable:
                summary["paths"][rp] = {"read_path": rp, "skipped": f"kvikio not importable ({caps.kvikio_error})"}
                continue
            summary["paths"][rp] = check_path(a, path, rp, prompts.tolist(), hf)
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    ran = [r for r in summary["paths"].values() if "skipped" not in r]
    summary["correct"] = bool(ran) and all(r["tokens_equal_transformers"] and r["logits_ok"] for r in ran)
    text = json.dumps(summary, indent=1, default=str)
    print(text)
    print(markdown(summary))
    if a.json is not None:
        a.json.write_text(text + "\n")
    return 0 if summary["correct"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
