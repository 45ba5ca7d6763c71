"""Engine output tokens/s on a medium random LLaVA with long prompts: this tree vs another
checkout (the code before a change) vs one ``generate()`` per request.

    .venv/bin/python benchmarks/bench_engine_medium.py --against /tmp/oldtree
        [--concurrency 32] [--prompt-tokens 2048] [--tokens 16] [--generate-requests 2]
        [--repeat 1] [--rounds 1] [--threads 1] [--device cpu|cuda] [--enforce-eager]
        [--dtype auto|float32|bfloat16]
        [--cpu-linear auto|onednn|torch] [--model-dir DIR] [--shape medium|llava-1.5-7b|...]
        [--peak-json DIR/peak.json] [--out figures.json]

The model (by default issue 11's "medium LLaVA") is built here, random, into ``--model-dir``
(default a fresh temporary folder; never committed; a folder that holds a model already is
used as it is): a Llama text model of hidden 896, 14 heads (2 KV heads, head_dim 64), 6
layers, intermediate 2432, 4k positions; a CLIP tower 768 wide (2 layers, 224x224 images,
patch 14: 256 image tokens). ``--shape`` picks another of ``medium_llava.SHAPES`` (e.g.
``llava-1.5-7b``, which ``scripts/gpu-check`` builds on the GPU and passes as
``--model-dir``). The tokenizer and chat template are the tiny LLaVA's
(``mmis.tiny_models.tiny_model``).

Workload: ``--concurrency`` requests, each one image (its own random pixels) and a text padded
to about ``--prompt-tokens`` prompt tokens, ``--tokens`` greedy output tokens (EOS ignored).

- ``engine``: :class:`EngineCore` built with ``make_core`` and the default
  :class:`EngineConfig` (KV pool sized to hold every request at once), all requests submitted,
  then ``step()`` until done, in a child process whose ``PYTHONPATH`` is this tree's
  ``server/``; ``engine@TREE`` is the same child run with ``TREE/server`` first on the path
  (``git worktree add /tmp/oldtree <commit>``), so both run the very same workload script;
- ``generate``: plain transformers, one ``generate(do_sample=False)`` per request, in turn,
  timed over the first ``--generate-requests`` requests (it is sequential: its tokens/s does
  not depend on how many requests are timed).

With ``--rounds 2`` or more the engine sides alternate (ABBA), best per side. The first
output tokens of the engines are compared with ``generate``'s for the requests both
ran. The engine's model FLOP/s is printed for the whole run and for the steps in which every
request decodes (``--tokens`` must exceed the prefill steps for such steps to exist). For
those steps it also prints the bytes roofline (``model_bytes.py``): the bytes a step must read,
the text model's weights once plus the KV of every row's context (the steps' mean), over the
device's copy bandwidth (``--peak-json``: ``benchmarks/device_peak.py``'s figure, which
``scripts/gpu-check`` measures in its peak step; else measured here the same way: CUDA a 2 GiB
device-to-device copy, CPU a 256 MiB memcpy; bytes read + written), and the measured step
time as a multiple of it (1.0x: as fast as the memory system allows). ``--out`` writes every
figure as JSON (the decode steps' under ``"decode"``: bytes per step, weights and KV, the
bandwidth and its source, measured and roofline ms per step, the multiple).
``--device cuda`` runs every side on the GPU in bfloat16 (KV blocks of ``--block-size``,
default the engine's; the attention backend ``mmis engine`` would choose there, FlexAttention
reading the pages in place; ``scripts/gpu-check`` runs it so) with the decode steps replayed as
CUDA graphs as ``mmis engine`` captures them (``engine/execution/decode_graphs.py``;
``--enforce-eager``: none; the count is printed per round), else the CPU in float32 (``--dtype``
overrides
either: ``bfloat16`` on a CPU with AMX). The engine child sets up its
process as ``mmis engine`` does (``engine/execution/host_memory.py``, where the tree has it). Ratios
are tokens/s over tokens/s; the last line is ``SUMMARY bench_engine_medium: ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from medium_llava import SHAPES, build_llava
from model_bytes import copy_bandwidth, decode_bytes, kv_bytes_per_token, weight_bytes
from model_flops import decode_flops, matmul_peak, model_flops

REPO = Path(__file__).resolve().parents[1]
COMPARED = 4
FILLER = (
    "The quick brown fox jumps over the lazy dog. A cat sits on a warm mat near the window "
    "while it rains outside. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. "
)


def workload(processor: Any, count: int, prompt_tokens: int) -> list[dict[str, Any]]:
    """Per request: prompt ids, the image's processor tensors, and its placeholder range."""
    from PIL import Image

    image_token = int(processor.tokenizer.convert_tokens_to_ids("<image>"))
    items = []
    text = "Describe this image."
    for k in range(count):
        pixels = np.random.default_rng(k).integers(0, 255, (224, 224, 3), dtype=np.uint8)
        body = text
        while True:
            messages = [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": body}]}
            ]
            prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
            inputs = processor(text=[prompt], images=[Image.fromarray(pixels)], return_tensors="np")
            ids = [int(t) for t in inputs["input_ids"][0]]
            if len(ids) >= prompt_tokens:
                break
            body = f"{FILLER * max(1, (prompt_tokens - len(ids)) // 40)}{body}"
        items.append(
            {
                "ids": ids,
                "pixel_values": np.asarray(inputs["pixel_values"], dtype=np.float32),
                "offset": ids.index(image_token),
                "length": ids.count(image_token),
            }
        )
    return items


def _dtype(args: argparse.Namespace) -> Any:
    import torch

    if args.dtype == "auto":
        return torch.bfloat16 if args.device == "cuda" else torch.float32
    return getattr(torch, args.dtype)


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def run_engine_child(args: argparse.Namespace) -> None:
    """In a child process: the whole engine core over the workload; prints one JSON line."""
    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoProcessor
    from tree_compat import add_request, module

    import mmis

    try:  # the process setup `mmis engine` does before loading (trees before it had none)
        keep_freed_memory = module("mmis.engine.execution.host_memory").keep_freed_memory
    except ImportError:
        pass
    else:
        keep_freed_memory()
    from mmis.engine.config import EngineConfig

    load_adapter = module("mmis.engine.execution.model").load_adapter
    ModelRunner = module("mmis.engine.execution.runner").ModelRunner
    make_core = module("mmis.engine.builder").make_core
    from mmis.protocol.messages import (
        EngineCoreRequest,
        FinishReason,
        MultiModalFeature,
        PlaceholderRange,
        SamplingParams,
    )

    processor = AutoProcessor.from_pretrained(args.model_dir)
    items = workload(processor, args.concurrency, args.prompt_tokens)
    adapter = load_adapter(args.model_dir, args.device, _dtype(args))
    linears = "torch (a tree without engine/execution/cpu_linear.py)"
    try:  # as `mmis engine` packs the language model's linears (trees before it had none)
        pack_adapter = module("mmis.engine.execution.cpu_linear").pack_adapter
    except ImportError:
        pass
    else:
        linears = pack_adapter(adapter, args.cpu_linear).describe()
    block = args.block_size
    need = sum(-(-(len(it["ids"]) + args.tokens) // block) for it in items) + 16
    runner = ModelRunner.create(adapter, block_size=block, num_blocks=need)
    graphs = 0
    if args.device == "cuda" and not args.enforce_eager:  # as `mmis engine` sets them up
        try:
            setup_graphs = module("mmis.engine.execution.decode_graphs").setup
        except ImportError:  # a tree before CUDA graphs
            pass
        else:
            longest = max(len(it["ids"]) for it in items) + args.tokens  # its --max-model-len
            runner.decode_graphs = setup_graphs(
                adapter,
                runner.pool,
                runner.backend,
                enforce_eager=False,
                max_num_seqs=args.concurrency,
                max_model_len=longest,
                tensor_parallel=False,
            )
            graphs = 0 if runner.decode_graphs is None else len(runner.decode_graphs.graphs)
    cfg = EngineConfig()
    best, decode = float("inf"), {"seconds": 0.0, "contexts": []}
    outputs: list[list[int]] = []
    execute = runner.execute
    steps: dict[str, Any] = {}

    def timed(batch: Any, *rest: Any, **kw: Any) -> Any:
        """The runner's step, timed when every request of the run decodes in it."""
        begin = time.perf_counter()
        result = execute(batch, *rest, **kw)
        seqs = list(batch.scheduled)
        if len(seqs) == args.concurrency and all(s.num_tokens == 1 for s in seqs):
            _sync(args.device)
            steps["seconds"] += time.perf_counter() - begin
            steps["contexts"].extend(s.start_position + 1 for s in seqs)
        return result

    runner.execute = timed  # type: ignore[method-assign]
    for _ in range(args.repeat):
        steps.update(seconds=0.0, contexts=[])
        runner.encoder_outputs.clear()
        core = make_core(cfg, runner)
        requests = []
        for k, it in enumerate(items):
            digest = f"img-{k}"
            feature = MultiModalFeature(
                modality="image",
                mm_hash=digest,
                placeholder=PlaceholderRange(it["offset"], it["length"]),
                data={"pixel_values": it["pixel_values"]},
            )
            requests.append(
                EngineCoreRequest(
                    request_id=f"r{k}",
                    prompt_token_ids=list(it["ids"]),
                    mm_features=[feature],
                    sampling_params=SamplingParams(
                        temperature=0.0, max_tokens=args.tokens, ignore_eos=True
                    ),
                )
            )
        order = {r.request_id: k for k, r in enumerate(requests)}
        outputs = [[] for _ in requests]
        start = time.perf_counter()
        with torch.inference_mode():
            for request in requests:
                add_request(core, request)
            unfinished = set(order)
            while unfinished:
                for out in core.step():
                    if out.finish_reason == FinishReason.ERROR.value:
                        raise SystemExit(f"engine failed {out.request_id}: {out.error}")
                    outputs[order[out.request_id]].extend(out.new_token_ids)
                    if out.finish_reason is not None:
                        unfinished.discard(out.request_id)
        _sync(args.device)
        seconds = time.perf_counter() - start
        if seconds < best:
            best, decode = seconds, dict(steps)
    print(
        json.dumps(
            {
                "seconds": best,
                "outputs": outputs,
                "decode": decode,
                "mmis": mmis.__file__,
                "graphs": graphs,
                "cpu_linear": linears,
            }
        )
    )


def run_generate(args: argparse.Namespace) -> tuple[float, list[list[int]]]:
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    torch.set_num_threads(args.threads)
    processor = AutoProcessor.from_pretrained(args.model_dir)
    items = workload(processor, args.generate_requests, args.prompt_tokens)
    model = AutoModelForImageTextToText.from_pretrained(
        args.model_dir, dtype=_dtype(args), device_map=args.device
    )
    model = model.eval()
    device = torch.device(args.device)
    outputs = []
    start = time.perf_counter()
    with torch.inference_mode():
        for it in items:
            gen = model.generate(
                input_ids=torch.tensor([it["ids"]], device=device),
                attention_mask=torch.ones(1, len(it["ids"]), dtype=torch.long, device=device),
                pixel_values=torch.from_numpy(it["pixel_values"]).to(device, model.dtype),
                max_new_tokens=args.tokens,
                do_sample=False,
                eos_token_id=[],
            )
            outputs.append([int(t) for t in gen[0, len(it["ids"]) :]])
    _sync(args.device)
    return time.perf_counter() - start, outputs


def device_bandwidth(args: argparse.Namespace) -> tuple[float, str]:
    """Bytes/s (read + written) of a large copy on the device, and where it comes from:
    ``--peak-json`` (``device_peak.py``'s ``copy``) when given, else measured here."""
    if args.peak_json is not None:
        copy = json.loads(args.peak_json.read_text())["copy"]
        return float(copy["gb_per_s"]) * 1e9, (
            f"{args.peak_json.name}: {int(copy['bytes']) >> 20} MiB copied, read + written"
        )
    bandwidth, copied = copy_bandwidth(args.device, args.threads)
    return bandwidth, f"measured: {copied >> 20} MiB copied, read + written"


def child(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(tree / "server"), OMP_NUM_THREADS=str(args.threads))
    cmd = [sys.executable, __file__, "--child", "--model-dir", str(args.model_dir)]
    cmd += ["--concurrency", str(args.concurrency), "--prompt-tokens", str(args.prompt_tokens)]
    cmd += ["--tokens", str(args.tokens), "--repeat", str(args.repeat)]
    cmd += ["--threads", str(args.threads), "--device", args.device, "--dtype", args.dtype]
    cmd += ["--cpu-linear", args.cpu_linear, "--block-size", str(args.block_size)]
    cmd += ["--enforce-eager"] if args.enforce_eager else []
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"engine child for {tree} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, help="another checkout (the baseline tree)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--block-size", type=int, default=16, help="KV block size (the engine's default: 16)"
    )
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--generate-requests", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=1, help="timed runs inside each child")
    parser.add_argument("--rounds", type=int, default=1, help="children per side, alternating")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument(
        "--shape", default="medium", choices=sorted(SHAPES), help="the model built (if none)"
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="every side's dtype (auto: bfloat16 on cuda, float32 on cpu)",
    )
    parser.add_argument(
        "--cpu-linear",
        default="auto",
        choices=["auto", "onednn", "torch"],
        help="the engine sides' --cpu-linear (engine/execution/cpu_linear.py; "
        "a tree without it: torch)",
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs for the engine's decode steps"
    )
    parser.add_argument(
        "--peak-json",
        type=Path,
        help="device_peak.py's JSON: its copy bandwidth for the bytes roofline (else measured)",
    )
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run_engine_child(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        if args.model_dir is None:
            args.model_dir = build_llava(Path(tmp) / args.shape, args.shape)
        elif not (args.model_dir / "config.json").exists():
            build_llava(args.model_dir, args.shape)
        t_gen, ref = run_generate(args)
        gen_tps = args.generate_requests * args.tokens / t_gen
        sides = {"engine": REPO}
        if args.against is not None:
            sides[f"engine@{args.against}"] = args.against
        total = args.concurrency * args.tokens
        print(
            f"{args.model_dir.name}, c={args.concurrency}, ~{args.prompt_tokens} prompt tokens + "
            "1 image, "
            f"{args.tokens} tokens each, {args.threads} thread(s), {args.device}, "
            f"{_dtype(args)}"
        )
        print(f"  generate: {gen_tps:8.2f} tok/s ({args.generate_requests} requests timed)")
        tps: dict[str, float] = {}
        decodes: dict[str, dict[str, Any]] = {}
        mismatches = 0
        order = list(sides)
        for round_ in range(args.rounds):  # ABBA...: drift of a shared machine hits both
            for name in order if round_ % 2 == 0 else order[::-1]:
                got = child(sides[name], args)
                if total / got["seconds"] > tps.get(name, 0.0):
                    tps[name], decodes[name] = total / got["seconds"], got["decode"]
                pairs = zip(got["outputs"], ref, strict=False)  # generate ran the first few
                bad = sum(1 for g, r in pairs if g[:COMPARED] != r[:COMPARED])
                mismatches += bad
                print(
                    f"  round {round_ + 1} {name}: {total / got['seconds']:8.2f} tok/s "
                    f"({got['seconds']:.1f} s; mmis from {got['mmis']}; CUDA graphs "
                    f"{got.get('graphs', 0)}; linears {got.get('cpu_linear', 'torch')}), "
                    f"first-token mismatches {bad}",
                    flush=True,
                )
        for name in order:
            print(f"  {name}: best {tps[name]:8.2f} tok/s, {tps[name] / gen_tps:.2f}x generate")
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(args.model_dir)
        lens = [len(it["ids"]) for it in workload(processor, args.concurrency, args.prompt_tokens)]
        flops = model_flops(args.model_dir, lens, args.tokens)
        peak, n = matmul_peak(args.device, args.threads, _dtype(args))
        achieved = flops / (total / tps["engine"])
        print(
            f"  engine model FLOP/s, whole run (prefill included): {achieved / 1e9:.1f} G "
            f"({flops / 1e12:.2f} TFLOP in the run) "
            f"vs matmul peak {peak / 1e9:.1f} G ({n}^3, {_dtype(args)}, "
            f"{args.threads} thread(s)): {achieved / peak:.1%}"
        )
        dec = decodes["engine"]
        decode_share = roofline = None
        decode_figures: dict[str, Any] | None = None
        if dec["contexts"]:
            steps = len(dec["contexts"]) // args.concurrency
            rate = decode_flops(args.model_dir, dec["contexts"]) / dec["seconds"]
            decode_share = rate / peak
            print(
                f"  engine model FLOP/s, steps where all {args.concurrency} requests decode "
                f"({steps} steps, {dec['seconds']:.2f} s): {rate / 1e9:.1f} G, "
                f"{decode_share:.1%} of peak"
            )
            itemsize = _dtype(args).itemsize
            bandwidth, source = device_bandwidth(args)
            weights = weight_bytes(args.model_dir, itemsize)
            kv = kv_bytes_per_token(args.model_dir, itemsize) * sum(dec["contexts"]) / steps
            floor = decode_bytes(args.model_dir, dec["contexts"], steps, itemsize) / bandwidth
            roofline = dec["seconds"] / floor
            decode_figures = {
                "steps": steps,
                "rows": args.concurrency,
                "seconds": dec["seconds"],
                "mean_context": sum(dec["contexts"]) / len(dec["contexts"]),
                "bytes_per_step": weights + kv,
                "weight_bytes": weights,
                "kv_bytes_per_step": kv,
                "bandwidth_gb_per_s": bandwidth / 1e9,
                "bandwidth_source": source,
                "ms_per_step": dec["seconds"] / steps * 1e3,
                "roofline_ms_per_step": floor / steps * 1e3,
                "x_roofline": roofline,
                "flops_share_of_peak": decode_share,
            }
            print(
                f"  decode steps' bytes roofline: {(weights + kv) / 1e9:.3f} GB read per step "
                f"({weights / 1e9:.3f} GB weights + {kv / 1e9:.3f} GB KV of the rows' "
                f"contexts, the steps' mean) over the copy bandwidth {bandwidth / 1e9:.1f} GB/s "
                f"({source}): {floor / steps * 1e3:.2f} ms/step; measured "
                f"{dec['seconds'] / steps * 1e3:.2f} ms/step = {roofline:.2f}x the roofline"
            )
        else:
            print(f"  no step had all {args.concurrency} requests decoding (raise --tokens)")
    figures = [
        f"engine/generate {tps['engine'] / gen_tps:.2f}x",
        f"of matmul peak {achieved / peak:.1%}",
    ]
    if decode_share is not None:
        figures.append(f"decode steps {decode_share:.1%} of peak")
    if decode_figures is not None:
        d = decode_figures
        figures.append(
            f"decode step {d['bytes_per_step'] / 1e9:.3f} GB read "
            f"({d['weight_bytes'] / 1e9:.3f} weights + {d['kv_bytes_per_step'] / 1e9:.3f} KV), "
            f"{d['ms_per_step']:.2f} ms vs {d['roofline_ms_per_step']:.2f} ms at "
            f"{d['bandwidth_gb_per_s']:.1f} GB/s ({d['bandwidth_source']}): "
            f"{d['x_roofline']:.2f}x bytes roofline"
        )
    if args.against is not None:
        old = tps[f"engine@{args.against}"]
        figures.append(f"engine/old tree {tps['engine'] / old:.2f}x")
        figures.append(f"old tree/generate {old / gen_tps:.2f}x")
    if args.out is not None:
        result = {
            "model": args.model_dir.name,
            "device": args.device,
            "dtype": str(_dtype(args)).removeprefix("torch."),
            "concurrency": args.concurrency,
            "prompt_tokens": args.prompt_tokens,
            "tokens": args.tokens,
            "tokens_per_s": tps,
            "generate_tokens_per_s": gen_tps,
            "model_flops_share_of_peak": achieved / peak,
            "decode": decode_figures,
            "mismatches": mismatches,
        }
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"SUMMARY bench_engine_medium: {args.model_dir.name} c={args.concurrency} "
        f"prompt~{args.prompt_tokens} "
        f"tokens={args.tokens}: {', '.join(figures)}; mismatches {mismatches}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
