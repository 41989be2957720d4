# sw.fault_tolerant on torchft: replica groups as separate jobs, one SIGKILLed, healed, compared.
# Its tests that start no process are in tests/unit/test_fault_tolerance_settings.py.
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import _fault_tolerance as ft

pytest.importorskip("torchft", reason="the ft extra (pip install 'shardwise[ft]') is not installed")

SCRIPT = str(Path(__file__).parents[1] / "_fault_tolerance.py")


def lighthouse(min_replicas=1):
    """``shardwise lighthouse`` on a free port of 127.0.0.1, short timeouts: (process, address)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "shardwise.cli", "lighthouse", "--host", "127.0.0.1", "--port", "0",
         "--min-replicas", str(min_replicas), "--join-timeout-ms", "2000", "--heartbeat-timeout-ms", "1000",
         "--quorum-tick-ms", "10"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        start_new_session=True)
    port = re.search(r":(\d+) ", process.stdout.readline()).group(1)
    return process, f"http://127.0.0.1:{port}"


#: the runs a test started: ended (groups and lighthouse) when it ends, passed or not
_RUNS = []


@pytest.fixture(autouse=True)
def _end_runs():
    yield
    while _RUNS:
        _RUNS.pop().close()


class Run:
    """Two replica groups of tests/_fault_tolerance.py under one lighthouse, in ``out``."""

    def __init__(self, out, *, layout="one", steps=40, pause=0.05, save_every=0, quorum=1,
                 local_sgd=0, diloco=False):
        self.out, self.layout, self.ranks = Path(out), layout, 1 if layout == "one" else 2
        self.args = ["--steps", str(steps), "--pause", str(pause), "--layout", layout,
                     "--save-every", str(save_every), "--local-sgd", str(local_sgd),
                     *(["--diloco"] if diloco else [])]
        self.every = local_sgd or 1
        self.house, address = lighthouse(quorum)
        self.env = dict(os.environ, TORCHFT_LIGHTHOUSE=address, NUM_REPLICA_GROUPS="2",
                        OMP_NUM_THREADS="1", FT_BARRIER=str(2 * self.ranks))
        _RUNS.append(self)
        self.groups = {g: self.start(g) for g in (0, 1)}
        self.starts = {0: 1, 1: 1}

    def start(self, group):
        command = [sys.executable, SCRIPT, str(self.out), *self.args]
        if self.ranks > 1:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc_per_node={self.ranks}", *command[1:]]
        with open(self.out / f"group{group}.out", "a") as log:
            return subprocess.Popen(command, env=dict(self.env, REPLICA_GROUP_ID=str(group)),
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def lines(self, group):
        path = self.out / f"group{group}_rank0.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line] \
            if path.exists() else []

    def wait_for(self, group, test, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self.lines(group)
            if test(lines):
                return lines
            for g, p in self.groups.items():
                assert p is None or p.poll() in (None, 0), f"group {g} failed:\n{self.output(g)}"
            time.sleep(0.005)
        raise AssertionError(f"group {group}: timed out waiting\n{self.output(group)}")

    def kill(self, group):
        """SIGKILL the group (launcher and ranks); its time."""
        ft.kill_group(self.groups[group])
        self.groups[group] = None
        return time.time()

    def restart(self, group):
        self.groups[group] = self.start(group)
        self.starts[group] += 1

    def lose_and_restart(self, group, before, alone, jitter=0.0):
        """Kill ``group`` after its ``before``-th step (and up to ``jitter`` s more), let the
        other group step ``alone`` times without it, restart it and wait for its first step:
        (the kill's time, the restarted group's lines)."""
        self.wait_for(group, lambda lines: sum(r["event"] == "stepped" for r in lines) >= before)
        time.sleep(random.uniform(0, jitter))
        killed = self.kill(group)
        self.wait_for(1 - group, lambda lines: sum(r["event"] == "stepped" and r["time"] > killed
                                                   for r in lines) >= alone)
        self.restart(group)
        return killed, self.wait_for(group, lambda lines: any(
            r["event"] == "stepped" and r["time"] > killed for r in lines))

    def stop_soon(self, extra=10):
        """End the run ``extra`` steps after the furthest group's step (both read the file
        long before they get there, so both stop at it)."""
        step = max((r["step"] for g in (0, 1) for r in self.lines(g) if r["event"] == "stepped"),
                   default=0)
        stop = -(-(step + extra) // self.every) * self.every  # local SGD: at an average
        (self.out / "stop_at.tmp").write_text(str(stop))
        (self.out / "stop_at.tmp").replace(self.out / "stop_at")

    def finish(self, timeout=180):
        try:
            for group, process in self.groups.items():
                code = process.wait(timeout=timeout)
                assert code == 0, f"group {group} exited {code}:\n{self.output(group)}"
        finally:
            self.close()
        finals = [torch.load(self.out / f"group{g}_final.pt") for g in (0, 1)]
        return finals

    def close(self):
        """Kill what is left of the groups, and the lighthouse."""
        for process in self.groups.values():
            if process is not None and process.poll() is None:
                ft.kill_group(process)
        if self.house.poll() is None:
            self.house.terminate()
            self.house.wait()

    def output(self, group):
        path = self.out / f"group{group}.out"
        return path.read_text()[-4000:] if path.exists() else ""


def assert_same_weights(finals, steps):
    """Both groups hold the same weights, and they are one process's on the batches the
    quorum applied."""
    first, second = finals
    assert first["state"] == second["state"]
    for name, value in first["weights"].items():
        assert torch.equal(value, second["weights"][name]), name
    reference = ft.replay(steps)
    for name, value in reference.items():
        torch.testing.assert_close(first["weights"][name], value, rtol=0, atol=1e-5)


def test_two_healthy_groups_equal_one_process_on_the_global_batch(tmp_path):
    """Every step's quorum holds both groups; the weights equal one process trained on both
    groups' batches together (each group reads its own half of the data). The lighthouse
    waits for both (a quorum of 2), so neither starts alone."""
    run = Run(tmp_path, steps=12, pause=0, quorum=2)
    finals = run.finish()
    steps = ft.applied_batches(tmp_path)
    assert [s for s, _ in steps] == list(range(1, 13))
    assert all(len(indices) == 2 * ft.BATCH for _, indices in steps)
    participants = {r["participants"] for g in (0, 1) for r in run.lines(g)
                    if r["event"] == "stepped"}
    assert participants == {2}
    halves = [{i for r in run.lines(g) if r["event"] == "batch" for i in r["index"]} for g in (0, 1)]
    assert not halves[0] & halves[1]
    assert_same_weights(finals, steps)


@pytest.mark.parametrize("layout", ["replicate", "tp"])
def test_groups_of_two_ranks_replicated_or_tensor_parallel_equal_one_process(tmp_path, layout):
    """Inside each group DDP (or tensor parallelism over 2 ranks); across groups torchft:
    one process on both groups' batches together (tensor-parallel ranks read one batch)."""
    run = Run(tmp_path, layout=layout, steps=6, pause=0, quorum=2)
    finals = run.finish()
    steps = ft.applied_batches(tmp_path)
    assert [s for s, _ in steps] == list(range(1, 7))
    assert_same_weights(finals, steps)


def kill_and_heal(tmp_path, layout):
    """Kill group 0 mid-run; group 1 goes on alone; group 0 restarted heals from it."""
    run = Run(tmp_path, layout=layout, steps=400, pause=0.05)
    killed, after = run.lose_and_restart(0, before=5, alone=5, jitter=0.1)
    run.stop_soon()
    finals = run.finish()
    joined = [r for r in after if r["event"] == "joined" and r["time"] > killed][0]
    healed = [r for r in after if r["event"] == "stepped" and r["time"] > killed][0]
    survivor = run.lines(1)
    gone = [r for r in survivor if r["event"] == "stepped" and killed < r["time"] < joined["time"]]
    in_flight = [r for r in gone if r["participants"] == 2]  # its quorum formed before the kill
    alone = [r for r in gone if r["participants"] == 1]
    print(f"\n{layout}: group 1 stepped {len(alone)} times alone; group 0 healed to step "
          f"{joined['healed_from']}; recovery (kill to the healed group's first step) "
          f"{healed['time'] - killed:.2f} s")
    assert run.starts[1] == 1 and sum(r["event"] == "start" for r in survivor) == 1
    assert len(in_flight) <= 1 and gone[len(in_flight):] == alone and len(alone) >= 5
    assert all(r["stepped"] for r in alone)
    assert joined["healed_from"] is not None and joined["healed_from"] >= alone[-1]["step"]
    lost = [r for r in survivor if r["event"] == "stepped" and not r["stepped"]]
    assert len(lost) <= 1  # at most the step in flight
    assert_same_weights(finals, ft.applied_batches(tmp_path))


def test_a_killed_group_heals_from_its_peer_which_never_stopped(tmp_path):
    kill_and_heal(tmp_path, "one")


def test_a_killed_group_of_two_sharded_ranks_heals_from_its_peer(tmp_path):
    kill_and_heal(tmp_path, "shard")


def together(run):
    """Both groups' last steps had both in the quorum (neither is down or healing)."""
    def both(lines):
        stepped = [r for r in lines if r["event"] == "stepped"]
        return len(stepped) >= 2 and all(r["participants"] == 2 for r in stepped[-2:])
    for group in (0, 1):
        run.wait_for(group, both)


def test_ten_kills_at_random_points_healing_and_saving_included(tmp_path):
    """Ten kills, the groups in turn: at a random moment, while the group saves a checkpoint,
    and while a restarted group heals. The survivor of each goes on; every restarted group
    heals; both end with the same weights, one process's on the applied batches; each
    group's newest checkpoint verifies and loads."""
    import shardwise as sw

    seed = random.randrange(10**6)
    rng = random.Random(seed)
    kinds = ["anywhere"] * 6 + ["saving"] * 2 + ["healing"] * 2
    rng.shuffle(kinds)
    run = Run(tmp_path, steps=10**6, pause=0.02, save_every=5)
    healing_hit, recoveries = 0, []
    for number, kind in enumerate(kinds):
        victim = number % 2
        together(run)
        if kind == "saving":
            run.wait_for(victim, lambda lines: lines[-1]["event"] == "saving")
        else:
            time.sleep(rng.uniform(0, 0.3))
        killed = run.kill(victim)
        run.restart(victim)
        if kind == "healing":
            run.wait_for(victim, lambda lines, t=killed: any(
                r["event"] == "joining" and r["time"] > t for r in lines))
            time.sleep(rng.uniform(0, 0.02))
            run.kill(victim)
            healing_hit += not any(r["event"] == "joined" and r["time"] > killed
                                   for r in run.lines(victim))
            killed = time.time()
            run.restart(victim)
        first = run.wait_for(victim, lambda lines, t=killed: any(
            r["event"] == "stepped" and r["time"] > t for r in lines))
        recoveries.append(min(r["time"] for r in first if r["event"] == "stepped"
                              and r["time"] > killed) - killed)
    together(run)
    run.stop_soon()
    finals = run.finish()
    print(f"\nseed {seed}: {kinds}; killed mid-heal {healing_hit} of 2 times; recovery "
          f"(kill to the healed group's first step) {min(recoveries):.2f}-{max(recoveries):.2f} s")
    assert run.starts == {g: 1 + len(kinds[g::2]) + kinds[g::2].count("healing") for g in (0, 1)}
    for group in (0, 1):
        healed = [r for r in run.lines(group) if r["event"] == "joined"][1:]
        assert all(r["healed_from"] is not None for r in healed[-1:])
    assert_same_weights(finals, ft.applied_batches(tmp_path))
    loaded = [r for g in (0, 1) for r in run.lines(g) if r["event"] == "joined" and r["loaded"]]
    assert any(r["healed_from"] is not None for r in loaded)  # sw.load, then healed by a peer
    model, optimizer, scheduler = ft.model_and_optimizer()
    bundle = sw.pipeline(sw.Env())(model, optimizer, scheduler=scheduler)
    for group in (0, 1):
        saved = [r["step"] for r in run.lines(group) if r["event"] == "saved"]
        state = sw.load(tmp_path / f"ckpt_group{group}", bundle)
        assert state.step in saved and state.step >= max(saved) - 5


@pytest.mark.parametrize(("diloco", "layout"), [(False, "one"), (True, "one"),
                                                (False, "replicate")],
                         ids=["local_sgd", "diloco", "local_sgd_over_ddp_groups"])
def test_local_sgd_and_diloco_across_groups_equal_two_replicas_in_one_process(tmp_path, diloco,
                                                                              layout):
    """Each group steps on its own batches (a group of 2 DDP ranks synchronously inside);
    every 3rd step the groups average their parameters (DiLoCo: their change, through
    Nesterov momentum): one process simulating the two groups gets the same weights."""
    run = Run(tmp_path, layout=layout, steps=12, pause=0, quorum=2, local_sgd=3, diloco=diloco)
    finals = run.finish()
    first, second = finals
    for name, value in first["weights"].items():
        assert torch.equal(value, second["weights"][name]), name
    reference = ft.replay_local_sgd(tmp_path, every=3, diloco=diloco)
    for name, value in reference.items():
        torch.testing.assert_close(first["weights"][name], value, rtol=0, atol=1e-5)


def test_diloco_survives_a_lost_group_and_heals_it(tmp_path):
    """DiLoCo every 3 steps: group 0 killed, group 1 averages alone, group 0 restarted heals
    at the next average (its weights, optimizers and the outer optimizer's momentum), and
    both end on one model."""
    run = Run(tmp_path, steps=10**6, pause=0.02, local_sgd=3, diloco=True)
    killed, after = run.lose_and_restart(0, before=6, alone=6)
    run.stop_soon()
    first, second = run.finish()
    joined = [r for r in after if r["event"] == "joined" and r["time"] > killed][0]
    assert joined["healed_from"] is not None and joined["healed_from"] % 3 == 0
    assert run.starts[1] == 1
    assert first["state"] == second["state"]
    for name, value in first["weights"].items():
        assert torch.equal(value, second["weights"][name]), name
