# Elastic restart: `shardwise launch --max_restarts` + `sw.fit(checkpoint_dir=...)` survive a rank
# killed mid-run and end exactly where an uninterrupted run ends.
import os
import subprocess
import sys

import torch

JOB = """
import os, signal, sys, torch
import shardwise as sw
from torch.utils.data import DataLoader
from shardwise.testing import SyntheticTokens, TinyTransformerLM

out, kill_at = sys.argv[1], int(sys.argv[2])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
env = sw.detect(timeout=30)
torch.manual_seed(0)
model = TinyTransformerLM(vocab=32, dim=16, heads=2, layers=2, dropout=0.1)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
loader = DataLoader(SyntheticTokens(size=48, seq_len=8), batch_size=4, shuffle=True, drop_last=True)
calls = []

def loss_fn(model, batch):
    calls.append(1)  # one call per micro-batch: the kill lands inside optimizer step kill_at
    if attempt == 0 and env.rank == 1 and len(calls) == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)  # no exception, no exit handler: a lost machine
    logits = model(batch["input_ids"])["logits"]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

bundle = sw.pipeline(env, sw.shard())(model, optimizer, loader, scheduler=scheduler,
                                      loss_fn=loss_fn)
latest = sw.latest_checkpoint(os.path.join(out, "ckpt"))
state = sw.fit(bundle, epochs=3, checkpoint_dir=os.path.join(out, "ckpt"), checkpoint_every=2,
               progress=False, log_every=None)
params = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
          for k, v in bundle.model.state_dict().items()}
if env.is_main:
    torch.save({"params": params, "step": state.step, "epoch": state.epoch, "attempt": attempt,
                "resumed_from": latest.name if latest else None},
               os.path.join(out, "result.pt"))
"""


def _launch(tmp_path, name, kill_at):
    out = tmp_path / name
    out.mkdir()
    script = tmp_path / "job.py"
    script.write_text(JOB)
    cmd = [sys.executable, "-m", "shardwise.cli", "launch", "--num_processes", "2",
           "--max_restarts", "1", str(script), str(out), str(kill_at)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "OMP_NUM_THREADS": "1",
                               "SHARDWISE_CONFIG_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out / "result.pt", weights_only=True), out, proc


def test_a_killed_rank_restarts_resumes_and_ends_equal_to_an_uninterrupted_run(tmp_path):
    whole, _, _ = _launch(tmp_path, "whole", kill_at=0)
    # 6 steps an epoch on 2 ranks; checkpoints at steps 2 and 4, rank 1 killed inside step 5
    resumed, out, proc = _launch(tmp_path, "killed", kill_at=5)
    assert whole["attempt"] == 0 and resumed["attempt"] == 1, proc.stderr[-3000:]
    assert (resumed["step"], resumed["epoch"]) == (whole["step"], whole["epoch"]) == (18, 3)
    assert all(torch.equal(resumed["params"][k], whole["params"][k]) for k in whole["params"])
    # the restarted attempt resumed from the last checkpoint before the kill, not from scratch
    assert whole["resumed_from"] is None and resumed["resumed_from"] == "step_00000004"
    assert "exitcode: -9" in proc.stderr  # the kill happened, and the launch still succeeded
