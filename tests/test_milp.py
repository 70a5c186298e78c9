"""The MILP on small synthetic instances: every constraint family, optima brute-forced through the simulator,
both solvers. `evaluate_tiers` times a tier list's step program with the simulator (plan/sim.py), not with the
MILP's rows, so the brute force checks the rows against the program."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest

from lazytrain.costmodel.topology import Topology
from lazytrain.errors import LazyTrainError
from lazytrain.plan.milp import MilpSolution, PlanningInstance, solve_instance
from lazytrain.plan.rules import Evaluation, evaluate_objective, evaluate_tiers, rule_tiers

SEED = 20261202
GB = 1e9


def random_instance(rng: random.Random, L: int, *, nvme: bool = True, tight: float = 1.0,
                    optimizer_mode: str = "overlap") -> PlanningInstance:
    """Heterogeneous layers and budgets sized so that memory, capacity and windows all bind sometimes; the host
    optimizer lane busy enough to be exposed in some windows; kept layers' graphs from half a boundary to
    four (some optima keep layers, some keep none)."""
    A = [rng.uniform(0.6, 1.4) * GB for _ in range(L + 1)]
    rho = [rng.uniform(0.02, 0.12) for _ in range(L)]
    apart = random.Random(A[0])  # the kept graphs' draws, apart: the other draws stay those without them
    inst = PlanningInstance(
        forward_s=rho,
        backward_s=[r * rng.uniform(2.0, 3.5) for r in rho],
        boundary_bytes=A,
        param_bytes=[rng.uniform(0.2, 1.5) * GB for _ in range(L)],
        gpu_act_bytes=tight * rng.uniform(4.5, 7.5) * GB,
        head_s=rng.uniform(0.01, 0.05),
        head_param_bytes=rng.uniform(0.1, 0.6) * GB,
        cpu_act_bytes=rng.uniform(0.9, 3.2) * GB,
        nvme_act_bytes=rng.uniform(0.9, 2.5) * GB if nvme else 0.0,
        h2d_bytes_per_s=rng.uniform(6, 14) * GB,
        d2h_bytes_per_s=rng.uniform(6, 14) * GB,
        nvme_read_bytes_per_s=rng.uniform(2, 4) * GB,
        nvme_write_bytes_per_s=rng.uniform(2, 4) * GB,
        optimizer_mode=optimizer_mode,
        land_s=tuple(rng.uniform(0.0, 0.15) for _ in range(L + 1)),
        embedding_s=rng.uniform(0.0, 0.05),
        optimizer_step_s=rng.uniform(0.1, 0.5),
        # overlap: the previous step's group updates fence the forward's weight h2d (some exposed, some hidden)
        update_s=tuple(rng.uniform(0.0, 0.08) for _ in range(L + 2)) if optimizer_mode == "overlap" else (),
        tied_head=rng.random() < 0.3,
        graph_bytes=[apart.uniform(0.5, 4.0) * GB for _ in range(L)],
    )
    # each layer's own working set (a hybrid model's mix), the head's; M_G is net of the largest
    working = [rng.choice([0.2, 1.5]) * rng.uniform(0.5, 1.0) * GB for _ in range(L)]
    head = rng.uniform(0.0, 1.5) * GB
    # the head's own weight and gradient slots (charged where live), or none (it streams through the layer slots)
    head_slot = apart.choice([0.0, apart.uniform(0.3, 2.0) * GB])
    return replace(inst, working_bytes=working, head_working_bytes=head, static_working_bytes=max(*working, head),
                   head_slot_bytes=head_slot)


def with_ranks(rng: random.Random, inst: PlanningInstance) -> PlanningInstance:
    """The instance for one rank of a drawn topology: each group's sum over the ranks on the optimizer lane from
    free to slower than its layer's backward, the gather of boundary 0's gradient rows too (or none)."""
    nodes = rng.choice([1, 2])
    topology = Topology(world_size=nodes * rng.choice([1, 2, 4]), nodes=nodes)
    topology = topology if topology.parallel else Topology(world_size=2)
    L = inst.num_layers
    return replace(inst, topology=topology, reduce_s=tuple(rng.choice([0.0, rng.uniform(0.0, 0.6)])
                                                           for _ in range(L + 1)),
                   gather_s=rng.choice([0.0, rng.uniform(0.0, 0.1)]))


def brute_force(inst: PlanningInstance, max_segment: int) -> tuple[float, tuple[str, ...] | None]:
    """The best objective over every tier list and every number of kept layers its gpu suffix allows (the
    simulator's step of each program); its tiers (None when nothing fits). `brute_force_kept` also gives K."""
    best, best_tiers, _ = brute_force_kept(inst, max_segment)
    return best, best_tiers


def brute_force_kept(inst: PlanningInstance, max_segment: int) -> tuple[float, tuple[str, ...] | None, int]:
    best, best_tiers, best_kept = math.inf, None, 0
    tiers_of = ("gpu", "cpu", "nvme", "recompute") if inst.nvme_act_bytes > 0 else ("gpu", "cpu", "recompute")
    L = inst.num_layers
    for inner in itertools.product(tiers_of, repeat=L - 1):
        tiers = ("gpu", *inner, "gpu")
        suffix = next(k for k in range(L + 1) if k == L or tiers[L - k - 1] != "gpu")  # gpu boundaries L-k..L
        for kept in range(suffix + 1 if inst.graph_bytes else 1):
            ev = evaluate_tiers(tiers, inst, max_segment=max_segment, kept_layers=kept)
            if ev.feasible and ev.objective < best - 1e-12:
                best, best_tiers, best_kept = ev.objective, tiers, kept
    return best, best_tiers, best_kept


@pytest.mark.parametrize("mode", ["overlap", "serial"])
@pytest.mark.parametrize("case", range(8))
def test_milp_optimum_equals_brute_force(case: int, mode: str) -> None:
    rng = random.Random(SEED + case)
    L = rng.randrange(2, 7)
    K = rng.randrange(2, 4)
    inst = random_instance(rng, L, nvme=case % 2 == 0, optimizer_mode=mode)
    assert_brute_force_optimum(inst, K)


def assert_brute_force_optimum(inst: PlanningInstance, K: int) -> tuple[MilpSolution, Evaluation] | None:
    """The MILP proves the brute force's optimum (or refuses when nothing fits), and its step of its own tiers and
    kept layers is their simulated step. Returns the solution and its evaluation (None when nothing fits)."""
    best, best_tiers = brute_force(inst, K)
    if best_tiers is None:
        with pytest.raises(LazyTrainError):
            solve_instance(inst, max_segment=K)
        return None
    sol = solve_instance(inst, max_segment=K)
    assert sol.report.status == "optimal" and sol.report.gap == pytest.approx(0, abs=1e-9)
    assert sol.report.objective == pytest.approx(best, rel=1e-6, abs=1e-9), (sol.tiers, best_tiers)
    ev = evaluate_tiers(sol.tiers, inst, max_segment=K, kept_layers=sol.kept_layers)
    assert ev.feasible and sol.step_s == pytest.approx(ev.step_s, rel=1e-6, abs=1e-9)
    return sol, ev


@pytest.mark.parametrize("case", range(8))
def test_milp_optimum_equals_brute_force_with_the_sums_over_the_ranks(case: int) -> None:
    """The sums over the ranks against the program: each group's reduce queued on the optimizer lane after its
    gradient d2h and before its land, the gather before the embedding backward, optimum over every tier list."""
    rng = random.Random(SEED + 300 + case)
    L, K = rng.randrange(3, 7), rng.randrange(2, 4)
    inst = with_ranks(rng, random_instance(rng, L, nvme=case % 2 == 0, tight=0.75,
                                           optimizer_mode=("overlap", "serial")[case % 2]))
    solved = assert_brute_force_optimum(inst, K)
    if solved is None:
        return
    sol, ev = solved
    alone = evaluate_tiers(sol.tiers, replace(inst, topology=Topology(), reduce_s=(), gather_s=0.0), max_segment=K,
                           kept_layers=sol.kept_layers)
    assert ev.step_s > alone.step_s + 1e-3  # the optimizer lane's queue of sums shows in the step


def with_states(rng: random.Random, inst: PlanningInstance) -> PlanningInstance:
    """The instance with its optimizer state on NVMe: a drawn staging depth, each group's file from a fraction of
    a boundary to a few (its read and write from hidden under a window to longer than the update), the updates
    from free to slower than a forward (serial mode too: they follow the backward group by group), the state
    files at the spills' rates on the NVMe links or their own."""
    L = inst.num_layers
    update_s = tuple(rng.choice([0.0, rng.uniform(0.0, 0.2)]) for _ in range(L + 2))
    state_rates = {f"state_{d}_bytes_per_s": rng.choice([None, rng.uniform(0.3, 3.0)
                                                           * getattr(inst, f"nvme_{d}_bytes_per_s")])
                   for d in ("read", "write")}
    return replace(inst, staging_depth=rng.randint(1, L), update_s=update_s, optimizer_step_s=sum(update_s),
                   state_bytes=tuple(rng.uniform(0.02, 1.0) * GB for _ in range(L + 2)), **state_rates)


@pytest.mark.parametrize("mode", ["overlap", "serial"])
@pytest.mark.parametrize("case", range(8))
def test_milp_optimum_equals_brute_force_with_the_states_on_nvme(case: int, mode: str) -> None:
    """The optimizer's state on NVMe against the program: each group's state read, update and write in the
    windows StateSchedule gives, sharing the NVMe lanes with the activations' spills and reads, the prefetch in
    the last backward windows, serial mode's updates through the slots after the backward; the optimum over every
    tier list and the MILP's step of its tiers are the simulator's."""
    rng = random.Random(SEED + 500 + case)
    L, K = rng.randrange(2, 7), rng.randrange(2, 4)
    inst = with_states(rng, random_instance(rng, L, nvme=case % 2 == 0, optimizer_mode=mode))
    solved = assert_brute_force_optimum(inst, K)
    if solved is None:
        return
    sol, ev = solved
    ram = evaluate_tiers(sol.tiers, replace(inst, staging_depth=0, state_bytes=(),
                                            update_s=inst.update_s if mode == "overlap" else ()),
                         max_segment=K, kept_layers=sol.kept_layers)
    assert ev.step_s >= ram.step_s - 1e-9  # the state ops only ever delay


def slow_and_tight(rng: random.Random, L: int, mode: str) -> PlanningInstance:
    """Where the tightened rows bite (milp/windows.py: the lifted windows, the backward rows' C[s]): a d2h link slower
    than the forward (an offload's copy and a segment's gradient d2h show in their windows), working sets of two
    to five boundaries (27B: 45 boundaries), the cap a few boundaries above the largest."""
    inst = random_instance(rng, L, nvme=rng.random() < 0.5, optimizer_mode=mode)
    A, rho = max(inst.boundary_bytes), sum(inst.forward_s) / L
    working = [rng.uniform(2.0, 5.0) * A for _ in range(L)]
    return replace(inst, d2h_bytes_per_s=A / (rng.uniform(1.2, 3.0) * rho), working_bytes=working,
                   static_working_bytes=max(*working, inst.head_working_bytes),
                   gpu_act_bytes=rng.uniform(1.5, 3.5) * A)


@pytest.mark.parametrize("case", range(10))
def test_milp_optimum_equals_brute_force_on_slow_links_and_large_working_sets(case: int) -> None:
    rng = random.Random(SEED + 500 + case)
    L, K = rng.randrange(3, 7), rng.randrange(2, 4)
    assert_brute_force_optimum(slow_and_tight(rng, L, ("overlap", "serial")[case % 2]), K)


def test_slow_and_tight_cases_recompute_and_offload() -> None:
    """The cases above are worth something only if their optima mix recompute with materialized boundaries
    (the backward rows' excess terms) and some offload despite the slow link (the lifted d2h rows)."""
    seen: set[str] = set()
    for case in range(10):
        rng = random.Random(SEED + 500 + case)
        L, K = rng.randrange(3, 7), rng.randrange(2, 4)
        _, tiers = brute_force(slow_and_tight(rng, L, ("overlap", "serial")[case % 2]), K)
        seen.update(tiers[1:-1] if tiers else ())
    assert {"recompute", "gpu"} <= seen and seen & {"cpu", "nvme"}


def test_brute_force_cases_exercise_every_tier() -> None:
    """The random cases above are only worth something if their optima use offload, nvme and recompute, and keep
    some layers' graphs in some cases and none in others."""
    seen: set[str] = set()
    kept: set[bool] = set()
    for case in range(8):
        rng = random.Random(SEED + case)
        L, K = rng.randrange(2, 7), rng.randrange(2, 4)
        _, tiers, num_kept = brute_force_kept(random_instance(rng, L, nvme=case % 2 == 0), K)
        seen.update(tiers or ())
        kept.add(num_kept > 0)
    assert {"cpu", "recompute"} <= seen and kept == {True, False}


@pytest.mark.parametrize("states", [False, True])
@pytest.mark.parametrize("mode", ["overlap", "serial"])
@pytest.mark.parametrize("case", range(3))
def test_fixed_tiers_objective_equals_the_simulated_step(case: int, mode: str, states: bool) -> None:
    """Random tier lists (nvme boundaries among them) fixed: the MILP's step is the simulated one; with the
    optimizer's state on NVMe too (its writes before a window's spill, its reads before the backward's)."""
    rng = random.Random(SEED + 100 + case)
    inst = random_instance(rng, 6, tight=2.0, optimizer_mode=mode)
    inst = with_states(rng, inst) if states else inst
    options = ("gpu", "cpu", "nvme", "recompute")
    checked = kept_checked = 0
    for _ in range(40):
        tiers = ("gpu", *(rng.choice(options) for _ in range(5)), "gpu")
        kept = rng.choice([0, 0, 1, 2, 6])  # some lists cannot keep that many: then infeasible
        ev = evaluate_tiers(tiers, inst, kept_layers=kept)
        if ev.feasible:
            sol = solve_instance(inst, max_segment=3, fixed_tiers=tiers, kept_layers=kept)
            assert sol.tiers == tiers and sol.kept_layers == kept
            assert sol.report.objective == pytest.approx(ev.objective, rel=1e-6, abs=1e-9)
            assert sol.step_s == pytest.approx(ev.step_s, rel=1e-6, abs=1e-9)
            checked += 1
            kept_checked += kept > 0
        else:
            with pytest.raises(LazyTrainError):
                solve_instance(inst, max_segment=3, fixed_tiers=tiers, kept_layers=kept)
    assert checked >= 3 and kept_checked >= 1


def test_megatrain_rule_is_a_feasible_point() -> None:
    rng = random.Random(SEED + 7)
    inst = random_instance(rng, 12, tight=3.0)
    tiers = rule_tiers("megatrain", 12, interval=4)
    sol = solve_instance(inst, max_segment=4, fixed_tiers=tiers)
    assert sol.tiers == tiers and sol.report.status == "optimal"
    assert sol.report.objective == pytest.approx(evaluate_objective(tiers, inst), rel=1e-6)
    free = solve_instance(inst, max_segment=4)
    assert free.report.objective <= sol.report.objective + 1e-9


def _uniform(L: int, **kw) -> PlanningInstance:
    base = dict(forward_s=[0.1] * L, backward_s=[0.3] * L, boundary_bytes=[GB] * (L + 1), param_bytes=[0.5 * GB] * L,
                gpu_act_bytes=100 * GB, head_s=0.05, head_param_bytes=0.3 * GB, h2d_bytes_per_s=12 * GB,
                d2h_bytes_per_s=12 * GB, nvme_read_bytes_per_s=3 * GB, nvme_write_bytes_per_s=3 * GB)
    base.update(kw)
    return PlanningInstance(**base)


def test_path_and_max_segment() -> None:
    inst = _uniform(10, gpu_act_bytes=9 * GB, cpu_act_bytes=0.0)  # nothing offloads: recompute must carry it
    for K in (2, 3):
        sol = solve_instance(inst, max_segment=K)
        kept = [i for i, t in enumerate(sol.tiers) if t != "recompute"]
        assert kept[0] == 0 and kept[-1] == 10
        assert max(b - a for a, b in zip(kept, kept[1:], strict=False)) <= K


def test_keep_all_step_by_hand() -> None:
    """Roomy device, slow h2d: every boundary kept, and the step is the sum of its windows, each the longest of
    its compute and its lanes: start (1 + 0.5 GB) / 1 GB/s = 1.5 s; F_0..F_4 stream 0.5 GB of next weights
    (0.5 s > 0.1 s), F_5 the head's 0.3 GB; H streams B_5's weights (0.5 s); B_5..B_1 the next layer's (0.5 s),
    B_0 computes 0.3 s; the end moves B_0's gradients and boundary 0's over d2h (1.5 GB / 12 GB/s)."""
    inst = _uniform(6, h2d_bytes_per_s=1 * GB)
    sol = solve_instance(inst)
    assert sol.tiers == ("gpu",) * 7
    expected = 1.5 + (5 * 0.5 + 0.3) + 0.5 + (5 * 0.5 + 0.3) + 1.5 / 12
    assert sol.step_s == pytest.approx(expected, rel=1e-9)
    assert sol.report.objective == pytest.approx(expected + 7 * inst.lambda_z, rel=1e-9)
    assert evaluate_tiers(sol.tiers, inst).step_s == pytest.approx(expected, rel=1e-9)


def test_cpu_capacity_binds() -> None:
    # Device room for few boundaries; cpu budget for exactly two; nvme off: the rest must be recomputed.
    inst = _uniform(8, gpu_act_bytes=5 * GB, cpu_act_bytes=2.5 * GB)
    sol = solve_instance(inst, max_segment=8)
    assert sol.tiers.count("cpu") <= 2 and "nvme" not in sol.tiers
    assert evaluate_tiers(sol.tiers, inst).feasible
    roomy = solve_instance(_uniform(8, gpu_act_bytes=5 * GB, cpu_act_bytes=50 * GB), max_segment=8)
    assert roomy.tiers.count("cpu") > 2 and roomy.report.objective < sol.report.objective


def test_nvme_capacity_binds_and_nvme_traffic_is_assigned() -> None:
    # The forward has room for 2 gpu boundaries among 0..4 (boundaries 5 and 6 are on the device during the last
    # layer anyway), cpu for one, nvme for two: with costly recompute, every boundary is kept, two on (fast) NVMe.
    inst = _uniform(6, forward_s=[1.0] * 6, gpu_act_bytes=4.5 * GB, cpu_act_bytes=1 * GB, nvme_act_bytes=2 * GB,
                    nvme_read_bytes_per_s=100 * GB, nvme_write_bytes_per_s=100 * GB)
    sol = solve_instance(inst, max_segment=6)
    assert sol.tiers.count("nvme") == 2 and sol.tiers.count("cpu") == 1 and "recompute" not in sol.tiers
    for i in (i for i, t in enumerate(sol.tiers) if t == "nvme"):
        for link in ("d2h", "nvme_write", "nvme_read", "h2d"):
            moved = sum(t.num_bytes for t in sol.transfers if t.boundary == i and t.link == link)
            assert moved == pytest.approx(GB, rel=1e-6), link
    smaller = solve_instance(_uniform(6, forward_s=[1.0] * 6, gpu_act_bytes=4.5 * GB, cpu_act_bytes=1 * GB,
                                      nvme_act_bytes=1 * GB), max_segment=6)
    assert smaller.tiers.count("nvme") == 1 and "recompute" in smaller.tiers


def test_gpu_memory_counts_recompute_blocks_and_reload_buffers() -> None:
    """Weak spot 3: the paper's sum A g <= M_G admits plans whose backward does not fit. Here M_G holds 6.5
    boundaries; a segment (s, e) needs the gpu boundaries below s and all of s..e at once."""
    inst = _uniform(12, gpu_act_bytes=6.5 * GB, cpu_act_bytes=0.0)
    sol = solve_instance(inst, max_segment=6)
    assert evaluate_tiers(sol.tiers, inst).feasible
    kept = [i for i, t in enumerate(sol.tiers) if t != "recompute"]
    for s, e in zip(kept, kept[1:], strict=False):
        assert sum(1 for i in range(s) if sol.tiers[i] == "gpu") + (e - s + 1) <= 6.5
    # the paper's static capacity alone (4 gpu boundaries <= 6.5) accepts MegaTrain's rule; its last segment
    # (8, 12) needs 2 + 5 = 7 boundaries at once, so the exact model refuses it
    tiers = rule_tiers("megatrain", 12, interval=4)
    assert tiers.count("gpu") <= 6.5
    assert not evaluate_tiers(tiers, inst).feasible
    with pytest.raises(LazyTrainError):
        solve_instance(inst, fixed_tiers=tiers)


def test_d2h_window_exposure_by_hand() -> None:
    """A slow d2h link cannot hide an offload in its window, nor gradients in theirs: each window lasts its
    longest lane."""
    inst = _uniform(4, gpu_act_bytes=100 * GB, d2h_bytes_per_s=2 * GB, lambda_z=0, lambda_c=0, lambda_n=0)
    tiers = ("gpu", "gpu", "gpu", "cpu", "gpu")
    # start 1.5 GB / 12 GB/s; F_0..F_2 0.1 s; F_3 the d2h of boundary 3: 1 GB / 2 GB/s; H: B_3's weights and
    # boundary 3's reload, 1.5 GB / 12 GB/s; B_3..B_0 0.3 s (gradients 0.3 or 0.5 GB / 2 GB/s hide); the end:
    # B_0's gradients and boundary 0's gradient, 1.5 GB / 2 GB/s
    expected = 0.125 + 0.3 + 0.5 + 0.125 + 4 * 0.3 + 0.75
    sol = solve_instance(inst, fixed_tiers=tiers)
    assert sol.step_s == pytest.approx(expected, rel=1e-9)
    assert evaluate_tiers(tiers, inst).step_s == pytest.approx(expected, rel=1e-9)
    on_device = solve_instance(inst, fixed_tiers=("gpu",) * 5)
    assert sol.step_s - on_device.step_s == pytest.approx(0.4 + 0.075, rel=1e-9)
    assert [(t.link, t.window) for t in sol.transfers] == [("d2h", 3), ("h2d", 4)]


def test_reload_buffer_is_counted_in_the_backward() -> None:
    """While segment (s, e) runs backward, the previous segment's start is reloaded into a device buffer."""
    inst = _uniform(4, gpu_act_bytes=3.5 * GB, cpu_act_bytes=10 * GB)
    # all kept, 1 and 2 on the cpu: the segment (2, 3) holds 2, 3 and the reload of 1 beside boundary 0 = 4 > 3.5
    assert not evaluate_tiers(("gpu", "cpu", "cpu", "gpu", "gpu"), inst).feasible
    assert evaluate_tiers(("gpu", "cpu", "cpu", "gpu", "gpu"), _uniform(4, gpu_act_bytes=4 * GB)).feasible
    with pytest.raises(LazyTrainError):
        solve_instance(inst, fixed_tiers=("gpu", "cpu", "cpu", "gpu", "gpu"))


def test_transfers_name_the_windows_of_the_step_program() -> None:
    inst = _uniform(8, gpu_act_bytes=5 * GB, cpu_act_bytes=3 * GB, nvme_act_bytes=3 * GB, h2d_bytes_per_s=4 * GB)
    sol = solve_instance(inst, max_segment=3)
    kept = [i for i, t in enumerate(sol.tiers) if t != "recompute"]
    end = dict(zip(kept, kept[1:], strict=False))
    assert sol.transfers
    for t in sol.transfers:
        e = end[t.boundary]
        expected = {"d2h": t.boundary, "nvme_write": t.boundary + 1, "h2d": e, "nvme_read": min(e + 1, 8)}[t.link]
        assert t.window == expected and t.num_bytes == GB, (sol.tiers, t)


def test_slow_reload_makes_recompute_worth_it() -> None:
    fast = solve_instance(_uniform(8, gpu_act_bytes=5 * GB, cpu_act_bytes=20 * GB), max_segment=4)
    slow = solve_instance(_uniform(8, gpu_act_bytes=5 * GB, cpu_act_bytes=20 * GB, h2d_bytes_per_s=0.5 * GB,
                                   d2h_bytes_per_s=0.5 * GB), max_segment=4)
    assert fast.tiers.count("cpu") > slow.tiers.count("cpu")


def test_infeasible_raises_with_numbers() -> None:
    inst = _uniform(6, gpu_act_bytes=2 * GB, static_device_bytes=10 * GB, gpu_mem_cap_bytes=12 * GB)
    with pytest.raises(LazyTrainError) as err:
        solve_instance(inst)
    msg = str(err.value)
    assert "\n" not in msg and "GiB" in msg and "--gpu-mem-cap" in msg


def test_bad_options_raise() -> None:
    inst = _uniform(4)
    for kwargs in ({"max_segment": 0}, {"time_limit_s": 0}, {"mip_rel_gap": -1}, {"solver": "cplex"}):
        with pytest.raises(LazyTrainError):
            solve_instance(inst, **kwargs)


def test_scip_agrees_with_highs() -> None:
    pytest.importorskip("pyscipopt")
    rng = random.Random(SEED + 55)
    inst = random_instance(rng, 10, tight=1.5)
    a = solve_instance(inst, max_segment=4, solver="highs")
    b = solve_instance(inst, max_segment=4, solver="scip")
    assert a.report.objective == pytest.approx(b.report.objective, rel=1e-6, abs=1e-9)
