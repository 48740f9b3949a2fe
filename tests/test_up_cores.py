"""`specd up` shares this machine's cores between the two model services it runs (issue 21): the target
takes every core, the draft a quarter (at least one), both with OMP_WAIT_POLICY=PASSIVE, so that their
passes do not oversubscribe the cores where several streams make them overlap; explicit thread
flags win, and a service on a GPU is left out of the share."""

import argparse
import os

import pytest

from specd.cli import build_parser
from specd.cli.common import UserError
from specd.cli.up import run, service_threads
from specd.deploy.local import share_cores, usable_cores


@pytest.mark.parametrize("cores, draft", [(1, 1), (2, 1), (4, 1), (16, 4)])
def test_the_target_takes_every_core_and_the_draft_a_quarter(cores, draft):
    threads = share_cores(cores)
    assert threads == {"draft": draft, "target": cores}
    # Where both compute at once: the cores plus a quarter (at least one), not twice the cores.
    running = threads["draft"] + threads["target"]
    assert running <= cores + max(1, cores // 4)
    assert running < 2 * cores or cores == 1


@pytest.mark.parametrize("cores", [1, 2, 4, 16])
@pytest.mark.parametrize("alone", ["draft", "target"])
def test_a_service_alone_on_the_cpu_takes_every_core(cores, alone):
    assert share_cores(cores, on_cpu=[alone]) == {alone: cores}


def test_usable_cores_are_this_process_affinity():
    assert usable_cores() == len(os.sched_getaffinity(0)) >= 1


def up_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["up", *flags])


def test_specd_up_gives_each_service_its_share_unless_told_otherwise():
    cores = usable_cores()
    on_cpu = ("--device", "cpu", "--draft-device", "cpu")
    assert service_threads(up_args(*on_cpu)) == share_cores(cores)
    assert service_threads(up_args(*on_cpu, "--threads", "3")) == {"draft": 3, "target": 3}
    assert service_threads(up_args(*on_cpu, "--draft-threads", "2")) == {"draft": 2, "target": cores}
    assert service_threads(up_args(*on_cpu, "--threads", "3", "--target-threads", "5")) == {"draft": 3, "target": 5}
    # A draft on a GPU computes nothing on the cores: the target takes them all, the draft its own default.
    assert service_threads(up_args("--device", "cpu", "--draft-device", "cuda:0")) == {
        "draft": None,
        "target": cores,
    }


@pytest.mark.parametrize("flags", [["--threads", "0"], ["--draft-threads", "0"], ["--target-threads", "-1"]])
def test_specd_up_refuses_fewer_than_one_thread(flags):
    with pytest.raises(UserError, match=flags[0]):
        run(up_args(*flags))


def test_specd_up_on_a_cluster_takes_no_per_service_threads():
    with pytest.raises(UserError, match="--draft-threads"):
        run(up_args("--ray-address", "auto", "--draft-threads", "1"))


@pytest.mark.parametrize(
    "flags, spins",
    [
        (["--engine", "llama.cpp"], True),
        (["--engine", "transformers"], False),
        (["--engine", "auto"], True),  # on the CPU with a .gguf file
        (["--engine", "auto", "--device", "cuda"], False),  # a target on a GPU runs transformers
    ],
)
def test_a_llama_cpp_service_drops_the_passive_wait_policy(flags, spins, tiny_gguf, monkeypatch):
    """ggml's threads meet at an OpenMP barrier after every op: under OMP_WAIT_POLICY=PASSIVE each one
    sleeps and wakes them (cli/serve.py: let_ggml_threads_spin). torch's threads keep it."""
    from specd.cli.serve import let_ggml_threads_spin

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    args = build_parser().parse_args(["serve", "target", "--model", str(tiny_gguf["target"]), *flags])
    let_ggml_threads_spin(args)
    assert ("OMP_WAIT_POLICY" not in os.environ) == spins
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    let_ggml_threads_spin(build_parser().parse_args(["serve", "target", "--model", "/no/such/dir", "--engine", "auto"]))
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"  # no GGUF: transformers
