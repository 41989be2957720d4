# Every layout through the whole run: resume, resume in one process, save at exit, export, a kill.
# Its tests that start no process are in tests/unit/test_lifecycle_matrix.py.
"""The lifecycle matrix (docs/reliability.md): each layout shardwise offers trains a tiny
Transformers Llama on real gloo ranks and goes through every event of a run's life:

(a) a checkpoint saved mid-epoch (step 2) is resumed in new processes at the same layout and
    ends (step 4) torch.equal to the uninterrupted run;
(b) the same checkpoint resumed in one process loads the saved weights exactly and ends
    within the layout's parity bound of the uninterrupted run (DeepSpeed's own format is
    per rank: one process is refused, naming the world size);
(c) a background save as the script's last act, followed by ``destroy_process_group()`` and
    a normal exit, is published (``latest`` names it) and loads the final weights exactly;
(d) ``sw.export`` loads with ``from_pretrained`` equal to the trained weights;
(e) a rank killed while writing a later checkpoint leaves ``latest`` on the previous one,
    intact, and the next save clears what the kill left.

Two process starts per layout: the first run (a's reference, the save at step 2, c, d),
then the resume (a) that ends killed mid-save (e); (b) and the checks run in the test's own
process. A layout is one line of ``LAYOUTS`` (tests/conftest.py);
``test_every_distributing_transform_is_in_the_matrix`` (tests/unit/test_lifecycle_matrix.py)
fails when a transform that spreads the model over ranks is in none.
"""

import shutil

import pytest
import torch
import torch.distributed as dist
from _moe import moe
from torch.utils.data import DataLoader

import shardwise as sw
from shardwise.errors import CheckpointError, RankFailedError
from shardwise.testing import max_param_diff, run_distributed

from conftest import LAYOUTS, llama
from conftest import Prompts as SharedPrompts

pytest.importorskip("transformers")

GLOBAL_BATCH = 4
ACCUMULATE = 2
SAVE_AT, STEPS = 2, 4  # optimizer steps: a save mid-epoch (4 steps an epoch), then its end
#: the layouts' deliberate departures from one process, as measured (see the tests of each)
ONE_PROCESS_BOUND = 1e-5


class Prompts(SharedPrompts):
    """32 prompts of 8 tokens: 8 global batches an epoch, 4 optimizer steps."""

    def __init__(self):
        super().__init__(size=32, seq=8, prompt=4, pad=3)


def token_sum(model, batch):
    """The loss the stage and slice layouts compute: a sum over labelled tokens, and their
    count (so every layout trains the same model as one process)."""
    out = model(**batch, num_items_in_batch=1)
    return out.loss, (batch["labels"][:, 1:] != -100).sum()


def own_loss(parts):
    """Whether the layout computes the token-sum loss itself (stages, slices)."""
    return any(isinstance(p, (sw.transforms.PipelineParallel, sw.transforms.ContextParallel))
               for p in parts)


def build(layout=None, model="llama"):
    """The bundle of ``layout`` (None: one process, training ``model``) on this process's
    ranks."""
    parts = layout.parts if layout is not None else ()
    env = sw.detect()
    if layout is not None and layout.nodes > 1:
        per_node = layout.ranks // layout.nodes
        env = sw.detect(num_nodes=layout.nodes, local_world_size=per_node,
                        node_rank=env.rank // per_node, local_rank=env.rank % per_node)
    kind = layout.model if layout is not None else model
    model = moe("qwen3") if kind == "moe" else llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    data_ranks = layout.data_ranks if layout is not None else 1
    loader = DataLoader(Prompts(), batch_size=GLOBAL_BATCH // data_ranks, shuffle=True)
    pipe = sw.pipeline(env, *parts, sw.accumulate_gradients(ACCUMULATE), sw.clip_gradients(0.5))
    mean = own_loss(parts) or (layout is not None and layout.mean_loss)
    return pipe(model, opt, loader, loss_fn=None if mean else token_sum)


def train(bundle, state, until, root=None):
    """Train to optimizer step ``until`` in one pass over the loader (a loop left early
    starts the next epoch); with ``root``, save at SAVE_AT there and return the weights then."""
    saved = None
    while state.step < until:
        for batch in bundle.loader:
            state, _ = bundle.step(state, batch)
            if root is not None and state.step == SAVE_AT and not state.window_batches:
                sw.save(root, bundle, state)
                saved = weights(bundle)
            if state.step == until and not state.window_batches:
                break
    return bundle.check(state), saved


def weights(bundle):
    """This rank's view of the whole model (every rank gathers; a stage its own part)."""
    return {k: v.detach().clone() for k, v in bundle.engine.full_state(bundle.model)}


def first_run(name, root):
    """The uninterrupted run: saves at step 2, exports at step 4, and ends as a script ends:
    a background save, then ``destroy_process_group()``."""
    layout = LAYOUTS[name]
    bundle = build(layout)
    state, at_save = train(bundle, bundle.init(), STEPS, root=f"{root}/run")
    sw.export(f"{root}/export", bundle)  # local SGD: the replicas averaged first
    final = weights(bundle)
    background = bundle.engine.own_checkpoint is None  # DeepSpeed writes its own, blocking
    sw.save(f"{root}/run", bundle, state, blocking=not background)
    dist.destroy_process_group()  # the script's last line: the save must still publish
    return {"at_save": at_save, "final": final, "background": background}


def _die_writing(*args, **kwargs):
    import os
    os._exit(9)


def resumed_run(name, root):
    """New processes: resume step 2 to the end (a), load what the first run saved at its
    exit (c), train on and die on rank 1 while writing the next checkpoint (e)."""
    layout = LAYOUTS[name]
    bundle = build(layout)
    state, _ = train(bundle, sw.load(f"{root}/run/step_{SAVE_AT:08d}", bundle), STEPS)
    resumed = weights(bundle)
    published = sw.load(f"{root}/run", bundle)
    loaded = weights(bundle)
    state, _ = train(bundle, published, STEPS + 1)
    rank = dist.get_rank()
    torch.save({"resumed": resumed, "loaded": loaded, "step": published.step},
               f"{root}/resumed_{rank}.pt")
    dist.barrier()
    if rank == 1:  # mid-write: DCP's shards (and DeepSpeed's files) never finish
        import os
        os.fsync = _die_writing
        torch.save = _die_writing
    sw.save(f"{root}/run", bundle, state)
    return "the save was not killed"


def whole(parts):
    """The model's weights from each rank's view (pipeline stages each hold a part)."""
    merged = {}
    for part in parts:
        merged.update(part)
    return merged


def equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def lighthouse():
    """``shardwise lighthouse`` on a free port of 127.0.0.1: (process, its address)."""
    import re
    import subprocess
    import sys

    house = subprocess.Popen(
        [sys.executable, "-m", "shardwise.cli", "lighthouse", "--host", "127.0.0.1", "--port",
         "0", "--min-replicas", "1", "--join-timeout-ms", "1000", "--heartbeat-timeout-ms",
         "500", "--quorum-tick-ms", "10"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True)
    return house, "http://127.0.0.1:" + re.search(r":(\d+) ", house.stdout.readline()).group(1)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_survives_the_whole_run(name, tmp_path, monkeypatch):
    layout = LAYOUTS[name]
    if layout.lighthouse:
        pytest.importorskip("torchft", reason="the ft extra is not installed")
        house, address = lighthouse()
        monkeypatch.setenv("TORCHFT_LIGHTHOUSE", address)
        try:
            survives(name, tmp_path)
        finally:
            house.terminate()
            house.wait()
        return
    survives(name, tmp_path)


def survives(name, tmp_path):
    layout = LAYOUTS[name]
    first = run_distributed(first_run, name, str(tmp_path), world_size=layout.ranks,
                            timeout=300)
    # rank 1 dies in the save; the job fails (its death, or a peer losing it, reported first)
    with pytest.raises(RankFailedError, match=r"died with exit code 9|Connection reset|closed"):
        run_distributed(resumed_run, name, str(tmp_path), world_size=layout.ranks, timeout=300)
    resumed = [torch.load(tmp_path / f"resumed_{r}.pt") for r in range(layout.ranks)]
    at_save, final = whole(r["at_save"] for r in first), whole(r["final"] for r in first)
    # (a) resumed at the same layout in new processes: the uninterrupted run, bit for bit
    assert equal(whole(r["resumed"] for r in resumed), final)
    # (c) the background save at exit was published, and is what the run ended with
    assert all(r["step"] == STEPS for r in resumed)
    assert equal(whole(r["loaded"] for r in resumed), final)
    # (e) the save killed mid-write left the previous checkpoint, intact, as latest
    run = tmp_path / "run"
    assert sw.latest_checkpoint(run) == run / f"step_{STEPS:08d}"
    assert (run / f".tmp.step_{STEPS + 1:08d}").is_dir()
    # (d) the export is the trained model, as Transformers loads it
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").state_dict()
    assert equal({k: exported[k] for k in final}, final)
    # (b) one process: the saved weights exactly, and the rest of the run within the bound
    one = build(model=layout.model)
    if not first[0]["background"]:  # an engine's own per-rank format: refused by name
        with pytest.raises(CheckpointError, match="written by the deepspeed engine, this "
                                                  "bundle runs the torch engine"):
            sw.load(run / f"step_{SAVE_AT:08d}", one)
        return
    state = sw.load(run / f"step_{SAVE_AT:08d}", one)
    assert equal(weights(one), at_save)
    state, _ = train(one, state, STEPS)
    if layout.equals_one_process:
        assert max_param_diff(weights(one), final) < ONE_PROCESS_BOUND
    # (e) and (c) again from one process: latest loads the end of the run, and the next
    # save clears what the kill left
    state = sw.load(run, one)
    assert state.step == STEPS and equal(weights(one), final)
    sw.save(run, one, state, name="after")
    assert not [p.name for p in run.iterdir() if p.name.startswith(".tmp.")]
    if name == "pp_1f1b":
        refuses_a_record_of_one_stage(run / f"step_{SAVE_AT:08d}", one)


def refuses_a_record_of_one_stage(checkpoint, bundle):
    """A pipeline checkpoint whose record names only the first stage's parameters (as rank 0
    wrote before the stages' groups were merged) is refused, naming what is missing."""
    import json

    from shardwise.checkpoint import integrity

    forged = checkpoint.with_name("forged")
    shutil.copytree(checkpoint, forged)
    meta = json.loads((forged / "shardwise.json").read_text())
    for group in meta["optimizer"]["param_groups"]:
        group["params"] = [n for n in group["params"] if "layers.2" not in n
                           and "layers.3" not in n and "lm_head" not in n and "norm" != n[-4:]]
    (forged / "shardwise.json").write_text(json.dumps(meta))
    files = {}
    for rank in range(2):
        files.update({n: sha for n, (sha, _) in integrity.digests_of(forged, rank).items()})
    (forged / integrity.MANIFEST).write_text(json.dumps({"files": files,
                                                        "sealed": integrity._sealed(files)}))
    with pytest.raises(CheckpointError, match="records no hyperparameters for"):
        sw.load(forged, bundle)
