"""Data parallelism in the planner: the sums over the ranks, bytes and seconds (hand-computed), the program and the
simulator with ranks, host bytes per node, and `lazytrain plan --world-size N --nodes M`."""

from __future__ import annotations

import json
import math
import random

import pytest
from test_sim import _plan, synthetic

from lazytrain.cli import main
from lazytrain.config import load_job_config
from lazytrain.costmodel.cost import CostModel
from lazytrain.costmodel.hardware import HardwareSpec
from lazytrain.costmodel.model import ModelSpec
from lazytrain.costmodel.topology import Topology, node_host_bytes, rank_host_room
from lazytrain.costmodel.workload import Workload
from lazytrain.errors import LazyTrainError
from lazytrain.job.batch import largest_feasible_batch
from lazytrain.plan.schedule import Shapes, build_program, program_for
from lazytrain.plan.sim import simulate

RNG = random.Random(20261203)
H800 = HardwareSpec.load("h800")


def test_a_reduce_to_the_owner_in_the_node_then_an_all_reduce_among_the_nodes_owners() -> None:
    S = RNG.randrange(10**6, 10**9)
    one_node = Topology(world_size=8)
    assert one_node.link_bytes(S) == pytest.approx((7 / 8 * S, 0.0))
    assert one_node.collective_s(S, H800) == pytest.approx(7 / 8 * S / 160e9)
    two_nodes = Topology(world_size=16, nodes=2)
    assert two_nodes.collective_s(S, H800) == pytest.approx(7 / 8 * S / 160e9 + 2 * (1 / 2) * S / 50e9)
    across = Topology(world_size=4, nodes=4)  # one GPU per node: no intra-node phase
    assert across.collective_s(S, H800) == pytest.approx(2 * 3 / 4 * S / 50e9)
    assert Topology().collective_s(S, H800) == 0.0 and not Topology().parallel


def test_the_embedding_rows_are_gathered_to_the_owner_then_across_nodes() -> None:
    S = RNG.randrange(10**5, 10**8)
    assert Topology(world_size=8).link_bytes(S, "gather") == pytest.approx((7 * S, 0.0))
    two_nodes = Topology(world_size=16, nodes=2)
    assert two_nodes.collective_s(S, H800, "gather") == pytest.approx(7 * S / 160e9 + 8 * S / 50e9)


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=0), "world_size"), (dict(world_size=6, nodes=4), "nodes must divide"),
])
def test_bad_topologies_are_one_line(kwargs: dict, match: str) -> None:
    with pytest.raises(LazyTrainError, match=match):
        Topology(**kwargs)


def test_a_hardware_file_without_link_rates_is_asked_for_them(tmp_path) -> None:
    path = tmp_path / "box.json"
    fields = {k: v for k, v in HardwareSpec.load("h800").to_dict().items()
              if k not in ("name", "intra_node_gbps", "inter_node_gbps", "mem_gbps", "grad_accumulate_gbps")}
    path.write_text(json.dumps(fields))
    box = HardwareSpec.load(path)
    assert box.intra_node_gbps is None
    with pytest.raises(LazyTrainError, match="no intra_node_gbps: set it in a hardware file"):
        Topology(world_size=2).collective_s(1000, box)
    assert HardwareSpec.load("h800").intra_node_gbps == 160.0 and HardwareSpec.load("h800").inter_node_gbps == 50.0


def test_one_rank_builds_the_program_it_always_did() -> None:
    cost = synthetic(4, forward=0.1)
    plan = _plan(["gpu", "cpu", "recompute", "gpu", "gpu"])
    assert program_for(plan, cost) == program_for(plan, cost, topology=Topology(world_size=1, nodes=1))
    assert not any(op.kind in ("reduce", "gather") for op in program_for(plan, cost).ops)


@pytest.mark.parametrize("dtype, dtype_bytes", [("fp32", 4), ("bf16", 2)])
def test_every_group_is_summed_once_after_its_d2h_and_before_its_land(dtype: str, dtype_bytes: int) -> None:
    """The runtime's order (distributed/grads.py): on the optimizer lane, every micro-batch, each group's reduce
    after its gradient's d2h and before its land, in fp32; the gather of boundary 0's rows before the embedding
    backward; the links move what one process moves."""
    L = 5
    cost = synthetic(L, forward=0.01, weight_bytes=800)
    cost.dtype_bytes = dtype_bytes  # (the bytes stay the hand-set ones)
    cost.hardware = cost.hardware.with_overrides(intra_node_gbps=math.inf)
    plan = _plan(["gpu", "recompute", "cpu", "gpu", "recompute", "gpu"])
    topology = Topology(world_size=4)
    for updates in (True, False):  # a step's first micro-batch and a later one
        program = build_program(plan.tiers, Shapes.from_cost(cost), updates=updates, topology=topology)
        ops = program.ops
        reduces = [op for op in ops if op.kind == "reduce"]
        assert sorted(op.target for op in reduces) == list(range(L + 1))  # every layer and the head, once
        grads = {op.target: op for op in ops if op.kind == "grads"}
        lands = {op.target: op for op in ops if op.kind == "land"}
        for op in reduces:
            assert op.lane == "optimizer" and op.after == (grads[op.target].index,)
            assert lands[op.target].after == (op.index,) and op.index < lands[op.target].index
            assert op.num_bytes == 800 // dtype_bytes * 4
        (gather,) = [op for op in ops if op.kind == "gather"]
        (grad0,) = [op for op in ops if op.kind == "grad0"]
        (embedding,) = [op for op in ops if op.kind == "embedding"]
        assert gather.lane == "optimizer" and gather.after == (grad0.index,) and embedding.after == (gather.index,)
        assert gather.num_bytes == cost.boundary_bytes[0]
    alone = simulate(plan, cost)
    ranks = simulate(plan, cost, topology=topology)
    assert ranks.link_bytes == alone.link_bytes | {"optimizer": (L + 1) * 800 // dtype_bytes * 4 + gather.num_bytes}
    assert alone.link_bytes["optimizer"] == 0  # every rank streams and sends everything; the sums are host work
    assert ranks.step_s == pytest.approx(alone.step_s)  # every link is free here: nothing exposed


def test_a_slow_link_queues_the_sums_on_the_optimizer_lane_and_the_step_adds_up() -> None:
    L = 3
    cost = synthetic(L, forward=0.01, weight_bytes=10**6)
    cost.hardware = cost.hardware.with_overrides(intra_node_gbps=1e-3)  # 1 MB/s: each group's reduce 0.5 s
    plan = _plan(["gpu"] * (L + 1))
    topology = Topology(world_size=2)
    res, alone = simulate(plan, cost, topology=topology), simulate(plan, cost)
    reduce_s = topology.collective_s(10**6, cost.hardware)
    assert reduce_s == pytest.approx(0.5)
    gather_s = topology.collective_s(cost.boundary_bytes[0], cost.hardware, "gather")
    assert res.busy_s["optimizer"] - alone.busy_s["optimizer"] == pytest.approx((L + 1) * reduce_s + gather_s)
    assert res.exposed_s["optimizer"] > 3 * reduce_s  # the backward of 3 layers takes 0.09 s: the sums dominate
    assert res.compute_s + sum(res.exposed_s.values()) == pytest.approx(res.step_s)


def test_a_node_holds_the_shared_part_once_and_each_rank_its_own() -> None:
    cost = CostModel(ModelSpec.load("qwen2.5-7b"), H800, Workload(8, 1024), optimizer="adamw")
    hb = cost.host_breakdown()
    one = node_host_bytes(cost, Topology())
    assert one["node"] == cost.static_host_bytes()
    eight = node_host_bytes(cost, Topology(world_size=8), rank_activation_bytes=10**9)
    # weights and the bf16 streamed copy shared, states and kept gradients sharded (distributed/shared.py, grads.py)
    assert eight["shared"] == (hb["weights"] + hb["streamed_copy"] + hb["optimizer_states"] + hb["grads"]
                               + hb["grad_sum"])
    pool = 2 * max(max(cost.spec.layer_params), cost.spec.head_params) * 2  # bf16 landing buffers
    reduce = 4 * max(max(cost.spec.layer_params), cost.spec.head_params)  # the fp32 sum of a bf16 gradient
    assert eight["per_rank"] == cost.static_host_bytes() - eight["shared"] + pool + reduce + 10**9
    assert eight["node"] == eight["shared"] + 8 * eight["per_rank"]
    room = rank_host_room(cost, Topology(world_size=8), H800.host_mem_bytes)
    full = node_host_bytes(cost, Topology(world_size=8), rank_activation_bytes=room)["node"]
    assert H800.host_mem_bytes - 8 <= full <= H800.host_mem_bytes


def test_plan_world_size_prints_the_ranks_step_and_memory(capsys) -> None:
    args = ["plan", "--model", "qwen2.5-3b", "--hardware", "h800", "--batch-size", "8", "--rule", "megatrain"]
    assert main([*args, "--world-size", "16", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "data parallel: 16 ranks on 2 node(s), 8 per node; gradients summed on the host after the d2h" in out
    assert "links 160 GB/s in a node, 50 GB/s between nodes" in out
    assert "tok/s over 16 ranks" in out and "host per node" in out and "8 x" in out
    assert main(args) == 0
    assert "data parallel" not in capsys.readouterr().out


def test_plan_world_size_errors_are_one_line(capsys) -> None:
    assert main(["plan", "--model", "qwen2.5-3b", "--hardware", "h800", "--world-size", "6", "--nodes", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nodes" in err[0] and "divides world_size (6)" in err[0]
    assert main(["plan", "--model", "qwen2.5-14b", "--hardware", "h800", "--batch-size", "8", "--rule", "megatrain",
                 "--world-size", "8", "--cpu-mem", "180GiB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "host memory per node: 8 ranks need" in err[0]


def test_max_batch_is_per_rank_with_the_node_host_shared_and_states_the_global_batch(capsys) -> None:
    """--max-batch with --world-size: the batch searched is per rank, each rank's host room is its share of the
    node's (here the host binds: 80 GB for two ranks), and the report gives the global batch."""
    args = ["plan", "--model", "qwen2.5-3b", "--hardware", "rtx3090", "--seq-len", "1024", "--optimizer-mode",
            "serial", "--cpu-mem", "80GB", "--gradient-accumulation-steps", "2"]
    job = load_job_config(overrides=["model=qwen2.5-3b", "hardware=rtx3090", "cutoff_len=1024", "optimizer_mode=serial",
                                     "cpu_mem_bytes=80GB", "gradient_accumulation_steps=2"])
    alone, _ = largest_feasible_batch(job, ModelSpec.load("qwen2.5-3b"), HardwareSpec.load("rtx3090"), "milp")
    assert main([*args, "--max-batch", "--world-size", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("2 ranks on 1 node(s): per rank")
    name, per_rank, *rest = out[1].split()
    assert name == "milp" and 0 < int(per_rank) < alone  # the node's host is shared by its two ranks
    assert " ".join(rest) == f"global batch {4 * int(per_rank)} ({per_rank} per rank x 2 ranks x 2 accumulated)"
    # the per-rank batch is the largest one rank of the two plans: one more row is refused with the reason
    for batch, code in ((int(per_rank), 0), (int(per_rank) + 1, 2)):
        assert main([*args, "--world-size", "2", "--batch-size", str(batch)]) == code
    assert "no placement fits" in capsys.readouterr().err


def test_batch_auto_plans_one_rank_and_says_the_global_batch(capsys) -> None:
    args = ["plan", "--model", "qwen2.5-3b", "--hardware", "rtx3090", "--seq-len", "1024", "--optimizer-mode",
            "serial", "--cpu-mem", "90GB", "--batch-size", "auto", "--world-size", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    note = out.splitlines()[0]
    batch = int(note.split("auto: ")[1].split()[0])
    assert f"auto: {batch} per rank, the largest" in note and f"(global batch {2 * batch} ({batch} per rank x 2 " \
        "ranks); next:" in note
    assert f"batch {batch} x seq 1024" in out and "data parallel: 2 ranks" in out
