"""Random routing vs the mmis endpoint picker: users asking several questions about their own
photo, over three ``mmis serve`` replicas (issue 33's benchmark; docs/ROUTING.md).

The stack is the routing tests' (``tests/kube/picker_stack.py``): a real kube-apiserver (the
test control plane, ``scripts/gotools``), three replicas of ``mmis serve`` on loopback
addresses announcing their cache events, the real ``mmis-epp`` and ``mmis-gateway``
forwarding each request where the picker says. Two configurations of the same picker:

- ``random``: only the framework's ``random-picker`` (what a Service's round robin gives: a
  repeat finds its photo on the replica it lands on about 1/N of the time);
- ``picker``: the configuration the operator deploys (``mmis_operator.routing.picker_config``): the
  mmis cache scorer beside the queue and KV-utilisation scorers.

Each configuration gets fresh replicas (cold caches). ``--users`` users, ``--concurrency`` of
them at a time; each sends ``--questions`` streamed questions about one photo of its own, one
after the other (the next once the previous answered): ``mmis bench serve``'s load loop and
client (``mmis.bench``) with its users-asking-in-turn workload (``--questions-per-image``: the
photo before each question, a user's requests in order, the concurrency counting users), on
this benchmark's photos and questions. The model is the tiny Qwen2-VL with
the hub's image settings (``qwen2-vl-hub``), so an 896x672 photo is 768 image tokens: a miss
pays decoding, the processor, the vision tower and the prefill of the image; a hit prefills the
new question only.

Figures per configuration: TTFT p50 / p90 over the repeat questions (2nd on) and over all,
requests/s and output tokens/s over the run, the share of repeats that reached a replica that
had served that photo before (routing hit rate), and the replicas' prefix-cache hit rate (their
``mmis_prefix_cache_hits_total / mmis_prefix_cache_queries_total``). Ratios: random / picker
for TTFT, picker / random for throughput. One JSON line; record it in benchmarks/README.md with
the ``uptime`` load.

    .venv/bin/python benchmarks/bench_routing.py [--users 12] [--concurrency 3] [--questions 4]
        [--rounds 1] [--width 896 --height 672] [--logs DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kube"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_photo_ttft import photo_jpeg
from kubecluster import Cluster, find_tools
from picker_stack import DESTINATION, PickerStack
from tools import go_tool

from mmis.bench.datasets import SampleRequest
from mmis.bench.serve import build_body, run_requests
from mmis.tiny_models.tiny_model import tiny_model_dir
from mmis_operator.routing import picker_config

QUESTIONS = (
    "What is in the picture?",
    "What colours dominate it?",
    "Is there any text in it?",
    "Describe its left half.",
    "Describe its right half.",
    "What would you call it?",
)


def random_config(ops_port: int, events: Any) -> dict[str, Any]:
    """The operator's configuration with the profile reduced to the framework's random picker."""
    config = picker_config(ops_port, events)
    config["plugins"] = [p for p in config["plugins"] if p["type"] not in ("max-score-picker",)] + [
        {"type": "random-picker"}
    ]
    config["schedulingProfiles"] = [
        {"name": "default", "plugins": [{"pluginRef": "random-picker"}]}
    ]
    return config


def prefix_hit_rate(stack: PickerStack) -> float:
    hits = queries = 0.0
    for r in stack.replicas:
        text = httpx.get(r.ops_url + "/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith("mmis_prefix_cache_hits_total"):
                hits += float(line.split()[-1])
            elif line.startswith("mmis_prefix_cache_queries_total"):
                queries += float(line.split()[-1])
    return hits / queries if queries else 0.0


def run(
    stack: PickerStack, users: int, questions: int, concurrency: int, size: tuple[int, int]
) -> dict[str, Any]:
    photos = [
        "data:image/jpeg;base64," + base64.b64encode(photo_jpeg(500 + u, *size)).decode()
        for u in range(users)
    ]
    samples = [
        SampleRequest(
            QUESTIONS[q % len(QUESTIONS)],
            len(QUESTIONS[q % len(QUESTIONS)].split()),
            (photos[u],),
            8,
            session=u,
            images_first=True,
        )
        for u in range(users)
        for q in range(questions)
    ]
    bodies = [build_body(s, "tiny", "/v1/chat/completions", temperature=0.0) for s in samples]
    outputs, wall = asyncio.run(
        run_requests(
            stack.url + "/v1/chat/completions",
            bodies,
            max_concurrency=concurrency,
            sessions=[s.session for s in samples],
        )
    )
    failed = [o for o in outputs if not o.success]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(outputs)} requests failed: {failed[0].error}")
    # per user, in order: (TTFT seconds, output tokens, replica address)
    results = [
        [
            (o.ttft, o.output_tokens, o.headers.get(DESTINATION, "").rsplit(":", 1)[0])
            for o in outputs[u * questions : (u + 1) * questions]
        ]
        for u in range(users)
    ]
    repeats = [r for rs in results for r in rs[1:]]
    routed_hits = 0
    for rs in results:
        seen = {rs[0][2]}
        for _, _, dest in rs[1:]:
            routed_hits += dest in seen
            seen.add(dest)
    ttft_all = [r[0] for rs in results for r in rs]
    ttft_rep = [r[0] for r in repeats]
    return {
        "ttft_p50_repeat_ms": round(1000 * statistics.median(ttft_rep), 1),
        "ttft_p90_repeat_ms": round(1000 * statistics.quantiles(ttft_rep, n=10)[-1], 1),
        "ttft_p50_all_ms": round(1000 * statistics.median(ttft_all), 1),
        "requests_per_s": round(len(ttft_all) / wall, 3),
        "output_tokens_per_s": round(sum(r[1] for rs in results for r in rs) / wall, 2),
        "routing_hit_rate": round(routed_hits / len(repeats), 3),
        "prefix_cache_hit_rate": round(prefix_hit_rate(stack), 3),
        "first_placements": sorted({rs[0][2] for rs in results}),
        "wall_s": round(wall, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--users", type=int, default=12, help="users, one photo each")
    parser.add_argument("--concurrency", type=int, default=3, help="users served at once")
    parser.add_argument("--questions", type=int, default=4, help="questions per user")
    parser.add_argument("--rounds", type=int, default=1, help="random/picker pairs to run")
    parser.add_argument("--width", type=int, default=896, help="photo width (px)")
    parser.add_argument("--height", type=int, default=672, help="photo height (px)")
    parser.add_argument("--logs", type=Path, default=None, help="keep the processes' logs here")
    args = parser.parse_args()
    epp, gateway = go_tool("mmis-epp"), go_tool("mmis-gateway")
    model = tiny_model_dir("qwen2-vl-hub")
    out: dict[str, Any] = {
        "users": args.users,
        "concurrency": args.concurrency,
        "questions": args.questions,
        "photo": f"{args.width}x{args.height}",
        "load": os.getloadavg()[0],
    }
    with tempfile.TemporaryDirectory() as scratch, Cluster(find_tools()) as cluster:
        tmp = args.logs or Path(scratch)
        for round_ in range(args.rounds):
            for name in ("random", "picker"):
                namespace = f"bench-{name}-{round_}"
                cluster.kubectl("create", "namespace", namespace)
                stack = PickerStack(
                    cluster, namespace, Path(tmp) / namespace, epp, gateway, model=model,
                    config_for=random_config if name == "random" else None,
                )  # fmt: skip
                with stack:
                    out[f"{name}_{round_}"] = run(
                        stack, args.users, args.questions, args.concurrency,
                        (args.width, args.height),
                    )  # fmt: skip
                cluster.kubectl("delete", "namespace", namespace, "--wait=false")
            r, p = out[f"random_{round_}"], out[f"picker_{round_}"]
            out[f"ratios_{round_}"] = {
                "ttft_p50_repeat": round(r["ttft_p50_repeat_ms"] / p["ttft_p50_repeat_ms"], 2),
                "ttft_p50_all": round(r["ttft_p50_all_ms"] / p["ttft_p50_all_ms"], 2),
                "output_tokens_per_s": round(
                    p["output_tokens_per_s"] / r["output_tokens_per_s"], 2
                ),
            }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
