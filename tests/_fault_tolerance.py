# One replica group of a fault_tolerant() run, its step log, and the one-process replay of it.
"""Run as a script (``python tests/_fault_tolerance.py OUT``, or under torchrun for several
ranks a group) it trains one replica group: every step it writes a line before the step
(the samples it is about to train on) and one after (what the step did), flushed, so a
group killed at any point leaves a log the replay can read. :func:`replay` trains one
process on exactly the batches the quorum applied, for the comparison.
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

SIZE, BATCH, FEATURES = 4096, 4, 8


class Numbered(Dataset):
    """Regression samples that carry their index, so a log can name what was trained on."""

    def __init__(self, size=SIZE):
        generator = torch.Generator().manual_seed(7)
        self.x = torch.randn(size, FEATURES, generator=generator)
        self.y = self.x @ torch.linspace(-1, 1, FEATURES).unsqueeze(1) + 0.1

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i], "index": i}


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + 0.01 * step))
    return model, optimizer, scheduler


def outer(params):
    """DiLoCo's outer optimizer (its paper's: Nesterov momentum on the averaged change)."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def loss_fn(model, batch):
    return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])


def main():
    import shardwise as sw

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--layout", default="one", choices=["one", "replicate", "shard", "tp"])
    parser.add_argument("--pause", type=float, default=0.0, help="seconds per step")
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--local-sgd", type=int, default=0, help="average every k steps")
    parser.add_argument("--diloco", action="store_true", help="with an outer Nesterov SGD")
    args = parser.parse_args()
    out = Path(args.out)
    env = sw.detect()
    group = int(os.environ["REPLICA_GROUP_ID"])
    inner = {"one": [], "replicate": [sw.replicate()],
             "shard": [sw.shard(policy=sw.by_class(torch.nn.Linear))],
             "tp": [sw.tensor_parallel(plan={"0": "colwise", "2": "rowwise"})]}[args.layout]
    model, optimizer, scheduler = model_and_optimizer()
    loader = DataLoader(Numbered(), batch_size=BATCH, shuffle=True)
    if args.local_sgd:
        inner.append(sw.local_sgd(every=args.local_sgd, outer=outer if args.diloco else None))
    pipe = sw.pipeline(env, *inner, sw.fault_tolerant(min_replicas=1, timeout=10,
                                                      quorum_timeout=60, hostname="127.0.0.1"))
    bundle = pipe(model, optimizer, loader, scheduler=scheduler, loss_fn=loss_fn)
    log = open(out / f"group{group}_rank{env.rank}.jsonl", "a")  # noqa: SIM115

    def write(**record):
        log.write(json.dumps({"time": time.time(), "group": group, **record}) + "\n")
        log.flush()

    write(event="start")
    mine = out / f"ready{group}_{env.rank}"
    if os.environ.get("FT_BARRIER") and not mine.exists():  # every group's first start
        mine.touch()
        while len(list(out.glob("ready*_*"))) < int(os.environ["FT_BARRIER"]):
            time.sleep(0.01)
    ckpt = out / f"ckpt_group{group}"
    write(event="joining")
    # a restarted group that saved resumes from its checkpoint; the peers, ahead, heal it
    resume = args.save_every and sw.latest_checkpoint(ckpt) is not None
    state = sw.load(ckpt, bundle) if resume else bundle.init()
    replicas = bundle.engine.replicas
    write(event="joined", step=state.step, healed_from=replicas.healed_from,
          participants=replicas.participants, loaded=bool(resume))
    def last_step(steps):  # the driver may end the run sooner: every group reads one file
        stop = out / "stop_at"
        return min(steps, int(stop.read_text())) if stop.exists() else steps

    while state.step < last_step(args.steps):
        for batch in bundle.loader:
            write(event="batch", step=state.step + 1, index=batch["index"].tolist())
            state, result = bundle.step(state, batch)
            write(event="stepped", step=state.step, stepped=result.stepped,
                  participants=replicas.participants)
            if args.save_every and result.stepped and state.step % args.save_every == 0:
                write(event="saving", step=state.step)
                sw.save(ckpt, bundle, state)
                write(event="saved", step=state.step)
            if args.pause:
                time.sleep(args.pause)
            if state.step >= last_step(args.steps):
                break
    weights = {name: value.clone() for name, value in bundle.engine.full_state(bundle.model)}
    if env.is_main:
        torch.save({"weights": weights, "state": state.to_dict(),
                    "discarded": replicas.discarded}, out / f"group{group}_final.pt")
    write(event="done", step=state.step)


def descendants(pid):
    """``pid`` and every process below it (torchrun's workers lead sessions of their own,
    so killing the launcher's process group leaves them running)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def kill_group(process):
    """SIGKILL a replica group: its launcher and every process it started, at once."""
    import signal

    for pid in descendants(process.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def records(out):
    """Every line of every rank's log, per file, in order."""
    return {path.name: [json.loads(line) for line in path.read_text().splitlines() if line]
            for path in sorted(Path(out).glob("group*_rank*.jsonl"))}


def applied_batches(out):
    """``[(step, [indices of every rank of every group in its quorum])]`` for the steps the
    quorum applied. A group's batch line counts where the quorum held as many groups as have
    lines (a group killed after the others committed had contributed its gradient); where it
    held fewer, a group killed before it joined that quorum has a line but no part in it, and
    only the groups that applied the step count."""
    batches, applied = {}, {}
    for name, lines in records(out).items():
        rank = int(name.split("_rank")[1].split(".")[0])
        for record in lines:
            if record["event"] == "batch":
                seen = batches.setdefault(record["step"], {})
                key = (record["group"], rank)
                assert key not in seen, f"group {key} read step {record['step']} twice"
                seen[key] = record["index"]
            elif record["event"] == "stepped" and record["stepped"]:
                applied.setdefault(record["step"], {})[record["group"]] = record["participants"]
    steps = []
    for step in sorted(applied):
        (participants,) = set(applied[step].values())  # the groups that applied it: one quorum
        lines = batches[step]
        if len({group for group, _ in lines}) > participants:
            lines = {key: value for key, value in lines.items() if key[0] in applied[step]}
        assert len({group for group, _ in lines}) == participants, (step, lines, participants)
        steps.append((step, [i for key in sorted(lines) for i in lines[key]]))
    return steps


def replay(steps):
    """One process trained on ``steps`` (from :func:`applied_batches`): its weights."""
    model, optimizer, scheduler = model_and_optimizer()
    data = Numbered()
    for _, indices in steps:
        batch = {"x": data.x[indices], "y": data.y[indices]}
        loss_fn(model, batch).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return {name: value.detach() for name, value in model.state_dict().items()}


if __name__ == "__main__":
    main()


def group_batches(out):
    """``{group: [(step, indices of every rank of the group)]}``: what each group trained
    on, step by step."""
    found = {}
    for name, lines in records(out).items():
        group = int(name[len("group"):name.index("_")])
        rank = [(r["step"], r["index"]) for r in lines if r["event"] == "batch"]
        found.setdefault(group, []).append(rank)
    return {group: [(ranks[0][i][0], [x for rank in ranks for x in rank[i][1]])
                    for i in range(len(ranks[0]))] for group, ranks in found.items()}


def replay_local_sgd(out, every, diloco):
    """Two groups of one process in one process, each on its own batches, averaged every
    ``every`` steps (with the outer optimizer under DiLoCo): their common weights."""
    data = Numbered()
    groups = [model_and_optimizer() for _ in range(2)]
    batches = group_batches(out)
    backup = [p.detach().clone() for p in groups[0][0].parameters()]
    outer_opt = outer(backup) if diloco else None

    def sync():
        params = [list(model.parameters()) for model, _, _ in groups]
        with torch.no_grad():
            if outer_opt is None:
                for tensors in zip(*params, strict=True):
                    mean = sum(t.detach() for t in tensors) / len(tensors)
                    for t in tensors:
                        t.copy_(mean)
                return
            for i, tensors in enumerate(zip(*params, strict=True)):
                backup[i].grad = sum(backup[i] - t.detach() for t in tensors) / len(tensors)
            outer_opt.step()
            outer_opt.zero_grad()
            for tensors in params:
                for t, b in zip(tensors, backup, strict=True):
                    t.copy_(b)

    sync()  # the join's average at step 0 (equal weights: no change; DiLoCo's momentum starts)
    steps = len(batches[0])
    for index in range(steps):
        for g, (model, optimizer, scheduler) in enumerate(groups):
            step, indices = batches[g][index]
            loss_fn(model, {"x": data.x[indices], "y": data.y[indices]}).backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if (index + 1) % every == 0:
            sync()
    return {name: value.detach() for name, value in groups[0][0].state_dict().items()}
