"""Several nodes, tested with two torchrun agents on one machine (c10d rendezvous on localhost: each
agent starts 2 of the 4 ranks, so RANK differs from LOCAL_RANK on the second): layouts spanning both
"nodes" train as under one agent, and a worker killed under one agent ends the other agent's ranks,
with a line naming the lost rank (one agent alone cannot see the other's failure)."""

import json
import os
import subprocess
import sys
import time

from tests.test_faults import FLAGS, LAYOUTS, ROOT, _left_running


def _launch(agents: int, args: list, env: dict):
    """`agents` torchrun agents of 4 // agents workers each, one rendezvous, and the rendezvous store
    (None for one agent). The test holds the store, as a cluster's head node does for its job:
    hosted by one of the agents, it would go with the first agent to exit, and the other agent's
    last calls to it would fail (a broken pipe) after training ended well."""
    store = None
    rendezvous = ["--standalone"]
    if agents > 1:
        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False)
        rendezvous = ["--nnodes", str(agents), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store.port}",
                      "--rdzv-id", f"job{store.port}", "--rdzv-conf", "is_host=false"]
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT), **env)
    return [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc-per-node",
                              str(4 // agents), str(ROOT / "tests" / "fault_script.py"), *args],
                             env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for _ in range(agents)], store


def _wait(launched) -> tuple[list[int], str]:
    agents, _store = launched  # the store lives until the agents are done
    try:
        outs = [a.communicate(timeout=600)[0] for a in agents]
    finally:
        for a in agents:
            a.kill()
    return [a.returncode for a in agents], "\n".join(outs)


def test_two_agents_train_as_one(tmp_path):
    """The same losses and gradient norms, digit for digit, over 3 iterations. Non-colocated, each
    module on its own agent's ranks: the boundary crosses the "nodes" (every layout's own numbers
    are test_parity's, under one launcher)."""
    metrics = {}
    for agents in (1, 2):
        path = tmp_path / f"metrics{agents}.jsonl"
        codes, out = _wait(_launch(agents, ["--hetero-layout", str(LAYOUTS / "non_colocated_2_2.yaml"), *FLAGS,
                                            "--train-iters", "3", "--metrics-file", str(path)], {}))
        assert codes == [0] * agents, out[-3000:]
        metrics[agents] = [(r["loss"], r["grad_norm"]) for r in map(json.loads, path.read_text().splitlines())]
    assert len(metrics[1]) == 3 and metrics[2] == metrics[1]


def test_worker_killed_under_one_agent_ends_the_other(tmp_path):
    """Rank 3 (the second agent's, or the first's: the rendezvous decides) is SIGKILLed in the LLM's
    forward at iteration 2: both agents exit non-zero, the other ranks each print a line naming
    rank 3, and no process is left."""
    mark = f"HETERO_TEST_MARK_{tmp_path.name}"
    killed = tmp_path / "killed"
    launched = _launch(2, ["--hetero-layout", str(LAYOUTS / "demo_colocated.yaml"), *FLAGS, "--train-iters", "3",
                           "--hetero-heartbeat-interval", "0.5"],
                       {"HETERO_TEST_FAULT": "kill:llm:2:3", "HETERO_TEST_KILLED": str(killed), mark: "1"})
    codes, out = _wait(launched)
    assert all(c != 0 for c in codes), codes
    assert time.time() - float(killed.read_text()) < 60, "the other agent's ranks took too long to stop"
    lines = [line for line in out.splitlines() if line.startswith("error: rank ")]
    assert {int(line.split()[2]) for line in lines} == {0, 1, 2}, out[-4000:]
    assert all("rank 3 (last heard in the LLM pipeline at iteration 2)" in line for line in lines), lines
    assert not _left_running(mark)
