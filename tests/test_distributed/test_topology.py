"""Role layouts (pure) and role-local process groups (real gloo ranks, torchrun, the deepspeed launcher)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dflash_ds.distributed.launch_env import read_launch_env
from dflash_ds.distributed.layout import Layout, make_layout
from dflash_ds.distributed.topology import init_role_groups, shutdown
from dflash_ds.errors import DFlashError
from dist_utils import child_env, free_port_block, run_ranks
from proc_utils import run_bounded

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "_launch_bridge_script.py"


def test_global_layout_last_ranks_are_targets() -> None:
    lay = make_layout(5, 2)  # drafters first (global rank 0 leads), the last T ranks are targets
    assert (lay.target_ranks, lay.drafter_ranks) == ([3, 4], [0, 1, 2])
    assert [lay.role_of(r) for r in range(5)] == ["drafter"] * 3 + ["target"] * 2
    assert [lay.local_rank_in_role(r) for r in range(5)] == [0, 1, 2, 0, 1]
    assert (lay.num_targets, lay.num_drafters) == (2, 3)


def test_per_node_layout_last_local_ranks_are_targets() -> None:
    lay = make_layout(8, None, nproc_per_node=4, targets_per_node=1)  # the last local rank of every node
    assert lay.target_ranks == [3, 7]
    assert lay.drafter_ranks == [0, 1, 2, 4, 5, 6]
    assert lay.local_rank_in_role(7) == 1 and lay.local_rank_in_role(4) == 3
    # Naming the total too is fine when it agrees.
    assert make_layout(8, 2, nproc_per_node=4, targets_per_node=1) == lay


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=3, num_target_ranks=3),
     "--num-target-ranks 3 leaves 0 drafter ranks in a world of 3: need at least one target and one drafter"),
    (dict(world_size=3, num_target_ranks=5), "--num-target-ranks 5 leaves 0 drafter ranks in a world of 3"),
    (dict(world_size=4, num_target_ranks=0), "--num-target-ranks 0 leaves 4 drafter ranks"),
    (dict(world_size=1, num_target_ranks=1), "a world of 1 rank(s) cannot hold a target and a drafter"),
    (dict(world_size=4, num_target_ranks=None), "give --num-target-ranks or --targets-per-node"),
    (dict(world_size=6, num_target_ranks=None, nproc_per_node=4, targets_per_node=1),
     "world size 6 is not a multiple of 4 ranks per node"),
    (dict(world_size=8, num_target_ranks=None, nproc_per_node=4, targets_per_node=4),
     "--targets-per-node 4 leaves 0 drafter ranks on a node of 4"),
    (dict(world_size=8, num_target_ranks=None, nproc_per_node=None, targets_per_node=1),
     "--targets-per-node 1 needs the number of ranks per node"),
    (dict(world_size=8, num_target_ranks=3, nproc_per_node=4, targets_per_node=1),
     "--num-target-ranks 3 disagrees with --targets-per-node 1 x 2 nodes = 2"),
    (dict(world_size=4, num_target_ranks=3, target_parallel=2),
     "topology.target_parallel 2 does not divide the 3 target ranks [1, 2, 3]"),
    (dict(world_size=6, num_target_ranks=4, nproc_per_node=3, target_parallel=2),
     "target replica [2, 3] (topology.target_parallel 2) spans two nodes of 3 ranks"),
    (dict(world_size=8, num_target_ranks=None, nproc_per_node=4, targets_per_node=1, target_parallel=2),
     "target replica [3, 7] (topology.target_parallel 2) is not 2 consecutive ranks"),
])
def test_layout_errors_name_the_numbers(kwargs: dict, message: str) -> None:
    with pytest.raises(DFlashError) as info:
        make_layout(**kwargs)
    assert message in str(info.value)


def test_layout_must_cover_every_rank_once() -> None:
    with pytest.raises(DFlashError, match="exactly once"):
        Layout(3, [0, 1], [1, 2])
    with pytest.raises(ValueError, match="outside a world of 3"):
        make_layout(3, 1).role_of(3)


def test_colocated_layout_every_rank_a_drafter_one_rank_enough() -> None:
    from dflash_ds.config import load_config
    from dflash_ds.runtime.launch import job_layout
    from dflash_ds.train import config_from_args

    cfg = config_from_args(["--colocate"])
    assert cfg.topology.colocate
    one, four = job_layout(cfg, 1, 1), job_layout(cfg, 4, 4)
    assert (one.target_ranks, one.drafter_ranks, one.num_targets, one.num_drafters) == ([], [0], 0, 1)
    assert four.drafter_ranks == [0, 1, 2, 3] and four.role_name(3) == "colocated"
    assert four.local_rank_in_role(3) == 3 and four.role_of(3) == "drafter"  # the ZeRO group is every rank
    assert four.describe().startswith("4 colocated rank(s)")
    assert job_layout(load_config(None, {}), 3, 3).role_name(2) == "target"
    with pytest.raises(DFlashError, match="--colocate runs the target on every rank: drop --num-target-ranks"):
        config_from_args(["--colocate", "--num-target-ranks", "1"])
    with pytest.raises(DFlashError, match="no target ranks of its own"):
        Layout(2, [1], [0], colocated=True)
    with pytest.raises(DFlashError, match="need at least one target and one drafter"):
        Layout(2, [], [0, 1])


def test_target_replicas_route_like_targets_and_send_from_their_first_rank() -> None:
    """topology.target_parallel k: consecutive target ranks form a replica; the router sees one target a replica."""
    lay = make_layout(6, 4, target_parallel=2)
    assert (lay.target_ranks, lay.replicas, lay.senders, lay.num_targets) == ([2, 3, 4, 5], [[2, 3], [4, 5]], [2, 4], 2)
    assert [lay.replica_of(r) for r in (2, 3, 4, 5)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # Global batch g = step * D + d goes to replica g mod 2, sent by its first rank.
    assert [lay.target_rank_for(step, d) for step in range(2) for d in range(2)] == [2, 4, 2, 4]
    assert "2 target replica(s) of 2 ranks [[2, 3], [4, 5]]" in lay.describe()
    assert make_layout(6, 4) == Layout(6, [2, 3, 4, 5], [0, 1])  # k = 1: every target rank sends, as before
    per_node = make_layout(8, None, nproc_per_node=4, targets_per_node=2, target_parallel=2)
    assert per_node.replicas == [[2, 3], [6, 7]] and per_node.node_local
    assert [per_node.target_rank_for(0, d) for d in range(4)] == [2, 2, 6, 6]  # each node's drafters, its replica


def test_colocated_with_a_sharded_target_is_one_clear_error() -> None:
    from dflash_ds.train import config_from_args

    with pytest.raises(DFlashError, match="colocated mode .* cannot shard it: use target ranks"):
        config_from_args(["--colocate", "--target-parallel", "2"])
    assert config_from_args(["--target-parallel", "2"]).topology.target_parallel == 2
    with pytest.raises(DFlashError, match="topology.target_parallel"):
        config_from_args(["--target-parallel", "0"])


def test_read_launch_env_says_how_to_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(DFlashError, match="torchrun or the deepspeed launcher"):
        read_launch_env()


def _role_group_worker(rank: int, port: int, out_dir: str) -> None:
    lay = make_layout(4, None, nproc_per_node=2, targets_per_node=1)  # targets 1, 3
    ctx = init_role_groups(lay, rank, "127.0.0.1", port, "gloo", timeout_s=60)
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)  # the default group is the role's, not the world's
    bridge_total = torch.tensor([float(rank)])
    ctx.bridge.allreduce([bridge_total]).wait()  # the bridge spans everyone
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "role": ctx.role, "role_rank": ctx.role_rank, "role_world": ctx.role_world,
        "dist_rank": dist.get_rank(), "dist_world": dist.get_world_size(),
        "role_sum": total.item(), "bridge_sum": bridge_total.item(),
        "env": [os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"], os.environ["LOCAL_SIZE"]],
    }))
    shutdown(ctx)


def test_role_groups_are_role_local(tmp_path: Path) -> None:
    port = free_port_block()
    run_ranks(_role_group_worker, 4, (port, str(tmp_path)), tmp_path, timeout_s=90)
    res = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)}
    assert [res[r]["role"] for r in range(4)] == ["drafter", "target", "drafter", "target"]
    for r, role_rank, role_sum, role_port in [(1, 0, 4.0, port + 2), (3, 1, 4.0, port + 2),
                                             (0, 0, 2.0, port + 3), (2, 1, 2.0, port + 3)]:
        assert res[r]["role_rank"] == res[r]["dist_rank"] == role_rank
        assert res[r]["role_world"] == res[r]["dist_world"] == 2
        assert res[r]["role_sum"] == role_sum
        assert res[r]["bridge_sum"] == 6.0
        assert res[r]["env"] == [str(role_rank), "2", str(role_port), "2"]


def _check_launch_results(out_dir: Path, port: int) -> None:
    res = {r: json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(3)}
    # Drafters first (ranks 0, 1), the target last (rank 2).
    assert res[2]["role"] == "target" and res[2]["dist_world"] == 1
    assert res[2]["env"] == {"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": str(port + 2), "LOCAL_RANK": "2"}
    for r in (0, 1):
        assert res[r]["role"] == "drafter"
        assert (res[r]["dist_rank"], res[r]["dist_world"]) == (r, 2)
        assert res[r]["role_sum_of_global_ranks"] == 1.0
        assert res[r]["env"] == {"RANK": str(r), "WORLD_SIZE": "2", "MASTER_PORT": str(port + 3),
                                 "LOCAL_RANK": str(r)}
        assert res[r]["batch_id"] == r
        assert res[r]["x"] == (torch.arange(6).view(2, 3) * (r + 1)).tolist()
        assert res[r]["meta"] == {"sent_by": 2.0}
        assert res[r]["agent_store_after"] is None


def test_torchrun_launch(tmp_path: Path) -> None:
    port = free_port_block()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3", "--master_port", str(port),
           str(SCRIPT), str(tmp_path)]
    proc = run_bounded(cmd, 120, env=child_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _check_launch_results(tmp_path, port)
    # torchrun had told the workers to use its agent store; init_role_groups dropped that.
    assert json.loads((tmp_path / "rank1.json").read_text())["agent_store_before"] == "True"


def test_deepspeed_launcher_launch(tmp_path: Path) -> None:
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent))
    if launcher is None:
        pytest.skip("the deepspeed launcher is not installed beside this python")
    port = free_port_block()
    cmd = [launcher, "--no_ssh", "--node_rank", "0", "--num_nodes", "1", "--num_gpus", "3",
           "--master_addr", "127.0.0.1", "--master_port", str(port), str(SCRIPT), str(tmp_path)]
    env = child_env()
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    proc = run_bounded(cmd, 150, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _check_launch_results(tmp_path, port)


def test_rank_helpers_follow_the_route() -> None:
    # The one routing rule: targets and drafters name each other's global ranks through the layout.
    for lay in (make_layout(5, 2), make_layout(8, None, nproc_per_node=4, targets_per_node=1)):
        for step in range(6):
            for d in range(lay.num_drafters):
                assert lay.target_rank_for(step, d) == lay.target_ranks[lay.route(step, d)]
                assert lay.drafter_rank_for(step * lay.num_drafters + d) == lay.drafter_ranks[d]
