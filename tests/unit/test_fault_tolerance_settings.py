# sw.fault_tolerant without processes: refusals, the data split across replica groups, explain.
# The runs with replica groups killed and healed are in tests/distributed/test_fault_tolerance.py.
import sys

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import shardwise as sw
from shardwise.cli import main as cli
from shardwise.errors import ArgumentError, ConflictError, FaultToleranceError
from shardwise.parallel.mesh import data_share
from shardwise.testing import TinyMLP


def one_process():
    return sw.Env(world_size=1, rank=0)


def test_without_torchft_the_transform_is_refused_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft raises ImportError
    model = TinyMLP()
    pipe = sw.pipeline(one_process(), sw.fault_tolerant(group=0, groups=1))
    with pytest.raises(FaultToleranceError, match=r"pip install 'shardwise\[ft\]'"):
        pipe(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_the_group_and_the_count_come_from_torchfts_variables():
    env = sw.detect(environ={"NUM_REPLICA_GROUPS": "2"})
    with pytest.raises(FaultToleranceError, match="REPLICA_GROUP_ID is not set"):
        sw.fault_tolerant().replica(env)
    env = sw.detect(environ={"NUM_REPLICA_GROUPS": "2", "REPLICA_GROUP_ID": "1",
                             "TORCHFT_LIGHTHOUSE": "http://127.0.0.1:29510"})
    assert sw.fault_tolerant().replica(env) == (1, 2)
    assert env.lighthouse == "http://127.0.0.1:29510"
    assert sw.fault_tolerant(group=0).replica(env) == (0, 2)  # given beats the variable
    env = sw.detect(environ={"NUM_REPLICA_GROUPS": "2", "REPLICA_GROUP_ID": "2"})
    with pytest.raises(FaultToleranceError, match=r"replica group 2 of 2; accepted: 0 \.\. 1"):
        sw.fault_tolerant().replica(env)
    with pytest.raises(sw.errors.EnvError, match="REPLICA_GROUP_ID must be an integer"):
        sw.detect(environ={"REPLICA_GROUP_ID": "x"})
    with pytest.raises(sw.errors.EnvError, match="NUM_REPLICA_GROUPS must be an integer >= 1"):
        sw.detect(environ={"NUM_REPLICA_GROUPS": "0"})
    with pytest.raises(sw.errors.EnvError, match="TORCHFT_LIGHTHOUSE='host:1' must be the"):
        sw.detect(environ={"TORCHFT_LIGHTHOUSE": "host:1"})
    with pytest.raises(sw.errors.EnvError, match="'replica_group' must be an integer >= 0"):
        sw.Env(replica_group="0")


@pytest.mark.parametrize("bad", [dict(min_replicas=0), dict(group=-1), dict(groups=0),
                                 dict(timeout=0), dict(group="1"), dict(groups=True),
                                 dict(max_discarded=0)])
def test_bad_settings_are_refused_by_name(bad):
    with pytest.raises(ArgumentError, match=next(iter(bad))):
        sw.fault_tolerant(**bad)


@pytest.mark.parametrize("other", ["shard_optimizer", "pipeline_parallel", "context_parallel",
                                   "expert_parallel"])
def test_what_is_not_carried_across_groups_is_refused_by_name(other):
    parts = {"shard_optimizer": [sw.replicate(), sw.shard_optimizer()]}.get(
        other, [getattr(sw, other)()])
    with pytest.raises(ConflictError, match=f"{other}\\(\\) is not carried across replica"):
        sw.pipeline(sw.Env(world_size=2, rank=0), *parts, sw.fault_tolerant(group=0, groups=2))


def test_the_data_is_split_over_every_groups_ranks_as_torchfts_sampler():
    pytest.importorskip("torchft")
    env = sw.Env(world_size=2, rank=1)
    assert data_share(env, None, (0, 3)) == (6, 1, 1)
    assert data_share(env, None, (2, 3)) == (6, 5, 1)
    # one process a group: group g reads share g of the groups
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2)
    model = TinyMLP()
    pipe = sw.pipeline(one_process(), sw.fault_tolerant(group=1, groups=2))
    bundle = pipe(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
    assert [b[0].tolist() for b in bundle.loader] == [[1.0, 3.0], [5.0, 7.0]]
    # each group evaluates the whole eval set (its metrics are its own group's)
    bundle = pipe(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                  eval_loader=DataLoader(TensorDataset(torch.arange(4.0)), batch_size=2))
    assert [b[0].tolist() for b in bundle.eval_loader] == [[0.0, 1.0], [2.0, 3.0]]


def test_a_step_before_the_group_joined_is_refused():
    pytest.importorskip("torchft")
    model = TinyMLP()
    pipe = sw.pipeline(one_process(), sw.fault_tolerant(group=0, groups=1))
    bundle = pipe(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(FaultToleranceError, match=r"call state = bundle.init\(\)"):
        bundle.step(sw.TrainState(), (torch.randn(2, 8), torch.randn(2, 1)))


def test_explain_says_what_a_lost_group_costs():
    text = sw.pipeline(sw.Env(world_size=2, rank=0), sw.shard(),
                       sw.fault_tolerant(group=1, groups=4)).explain()
    assert "torchft across replica groups (group 1 of 4" in text
    assert "a step a group is lost in is discarded" in text
    assert "a lost group's batches not trained" in text


def test_the_lighthouse_command_refuses_bad_numbers(capsys):
    assert cli(["lighthouse", "--min-replicas", "0"]) == 2
    assert "--min-replicas 0: accepted: an integer >= 1" in capsys.readouterr().err
    assert cli(["lighthouse", "--min-replicas", "1", "--port", "70000"]) == 2
    assert "--port 70000: accepted: 0 .. 65535" in capsys.readouterr().err


def test_save_with_its_arguments_swapped_is_refused_by_name(tmp_path):
    model = TinyMLP()
    bundle = sw.pipeline(one_process())(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ArgumentError, match=r"save\(directory, bundle, state\): got a TrainState "
                                            "as bundle and a PosixPath as state"):
        sw.save(bundle, bundle.init(), tmp_path)


def test_diloco_needs_replica_groups_and_a_callable_outer_optimizer():
    outer = lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)  # noqa: E731
    with pytest.raises(ConflictError, match=r"needs fault_tolerant\(\): outer= \(DiLoCo\)"):
        sw.pipeline(sw.Env(world_size=2, rank=0), sw.replicate(), sw.local_sgd(2, outer=outer))
    with pytest.raises(ArgumentError, match=r"local_sgd\(outer=0.7\): accepted: a callable"):
        sw.local_sgd(2, outer=0.7)
    text = sw.pipeline(sw.Env(world_size=2, rank=0), sw.replicate(),
                       sw.local_sgd(2, outer=outer), sw.fault_tolerant(group=0, groups=2)).explain()
    assert "torchft across replica groups" in text
    assert "local SGD across torchft's replica groups: each group trains on its own" in text
    assert "DiLoCo: the change since the last average" in text


class _Payload:
    """What a forged peer could send: unpickling it would run code."""

    def __reduce__(self):
        return (print, ("code from a peer ran",))


def test_a_peers_state_is_read_weights_only_and_a_forged_one_refused(capsys):
    """The heal's transport reads a peer's state with torch's weights_only unpickler: what
    shardwise sends (tensors, AdamW's and a scheduler's state, the TrainState) arrives; an
    object that would run code on unpickling is refused."""
    pytest.importorskip("torchft")
    from datetime import timedelta

    from torchft.checkpointing.http_transport import HTTPTransport

    from shardwise.fault_tolerance.healing import held_state
    from shardwise.fault_tolerance.joining import weights_only_transport

    model = TinyMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.randn(2, 8), torch.randn(2, 1)).backward()
    optimizer.step()
    scheduler.step()
    held = held_state(model, optimizer, scheduler, None, sw.TrainState(step=3, epoch=1))
    timeout = timedelta(seconds=10)
    honest, forged, mine = (HTTPTransport(timeout=timeout, num_chunks=0),
                            HTTPTransport(timeout=timeout, num_chunks=0),
                            weights_only_transport(timeout, "127.0.0.1"))
    try:
        honest.send_checkpoint(dst_ranks=[1], step=1, state_dict={"user": held}, timeout=timeout)
        got = mine.recv_checkpoint(src_rank=0, metadata=honest.metadata(), step=1,
                                   timeout=timeout)["user"]
        assert mine.metadata().startswith("http://127.0.0.1:")  # the hostname= given
        assert got["train_state"] == {**sw.TrainState(step=3, epoch=1).to_dict()}
        assert torch.equal(got["model"]["p:fc1.weight"], model.fc1.weight)
        forged.send_checkpoint(dst_ranks=[1], step=1, state_dict={"user": _Payload()},
                               timeout=timeout)
        with pytest.raises(Exception, match="Unsupported global: GLOBAL print"):
            mine.recv_checkpoint(src_rank=0, metadata=forged.metadata(), step=1, timeout=timeout)
        assert "code from a peer ran" not in capsys.readouterr().out
    finally:
        for transport in (honest, forged, mine):
            transport.shutdown(wait=False)
