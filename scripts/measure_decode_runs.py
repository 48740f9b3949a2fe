"""Target-only (K = 0) decode rate of the default pair through the loopback lab at RTT 0, 5 and 20 ms
(deploy/lab.py: `specd up` with the delay proxy between the orchestrator and the services), for
whichever specd this interpreter imports: run it in two checkouts, alternating, to compare them
(docs/results/decode_runs_lab_zen4.json: before and after Decode runs).

    .venv/bin/python scripts/measure_decode_runs.py LABEL     # writes /tmp/decode_runs_LABEL.json
"""

import asyncio
import json
import statistics
import sys

from specd.deploy.lab import Lab, LabConfig
from specd.proto.client import channel, complete, make_request
from specd.v1 import specdecode_pb2_grpc

PROMPTS = ("def quicksort(arr):", "class LRUCache:\n    def __init__(self, capacity: int):")


async def main(label):
    results = []
    async with Lab(LabConfig(namespaces=False)) as lab:
        await lab.deploy()
        async with channel(lab.address) as orchestrator:
            stub = specdecode_pb2_grpc.SpecDecodeStub(orchestrator)
            await complete(stub, make_request(PROMPTS[0], 16, draft_tokens=0, ignore_eos=True))
            for rtt in (0.0, 5.0, 20.0):
                lab.set_rtt(rtt)
                rates, steps = [], []
                for prompt in PROMPTS * 2:
                    done = await complete(stub, make_request(prompt, 64, draft_tokens=0, ignore_eos=True))
                    stats = done.final.stats
                    # decode rate after the first token (the prefill): tokens 2..64 over their time
                    total = stats.draft_seconds + stats.verify_seconds + stats.other_seconds
                    rates.append(63 / (total - stats.time_to_first_token_s))
                    steps.append(stats.steps)
                results.append(
                    {
                        "rtt_ms": rtt,
                        "decode_tok_s": round(statistics.median(rates), 2),
                        "steps": statistics.median(steps),
                    }
                )
                print(label, results[-1], flush=True)
    json.dump(results, open(f"/tmp/decode_runs_{label}.json", "w"))


asyncio.run(main(sys.argv[1]))
