"""The cluster config: the shipped example loads, and bad values are refused with their key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from opd.cluster.config import ClusterConfig
from opd.cluster.session import RayCluster
from opd.config import ConfigError, from_dict, load_yaml

EXAMPLE = Path(__file__).resolve().parents[2] / "configs" / "cluster_ray.yaml"


def test_example_config_loads():
    cfg = load_yaml(EXAMPLE, ClusterConfig)
    assert cfg.mode == "ray" and cfg.address == "auto"
    assert [(t.name, t.replicas, t.num_gpus) for t in cfg.teachers] == [("math", 2, 1.0), ("code", 1, 1.0)]
    assert cfg.teacher("math").serve_args[:2] == ["--max-k", "64"]
    assert cfg.student.num_workers == 1 and cfg.student.backend == "auto"
    # What its header says it is: the `cluster:` section of an opd train config (it had 2
    # student workers, which opd train refuses).
    import yaml

    from opd.distill.config import TrainConfig

    section = yaml.safe_load(EXAMPLE.read_text())
    train = from_dict({"student": {"path": "s"}, "cluster": section,
                       "merge": {"teachers": [{"name": n, "address": "tcp://127.0.0.1:*"} for n in ("math", "code")],
                                 "datasets": [{"domain": "math", "path": "m.jsonl"}]}}, TrainConfig)
    assert train.cluster == cfg


def test_the_sharded_example_is_a_cluster_section_of_opd_train_and_opd_rl_with_its_ranks_on_ray():
    from opd.distill.config import TrainConfig
    from opd.rl.config import RLConfig

    path = EXAMPLE.with_name("cluster_ray_sharded.yaml")
    cfg = load_yaml(path, ClusterConfig)
    assert cfg.ranks_on_ray and (cfg.student.num_workers, cfg.student.num_gpus_per_worker) == (16, 1.0)
    import yaml

    section = yaml.safe_load(path.read_text())
    train = from_dict({"student": {"path": "s"}, "cluster": section, "rollout": {"prompts_per_step": 32},
                       "merge": {"teachers": [{"name": "math", "address": "tcp://10.0.0.9:5601"}],
                                 "datasets": [{"domain": "math", "path": "m.jsonl"}]}}, TrainConfig)
    assert train.cluster == cfg
    rl = from_dict({"model": {"path": "m"}, "data": {"train": "t.jsonl"}, "rollout": {"prompts_per_step": 16},
                    "cluster": section}, RLConfig)
    assert rl.cluster.ranks_on_ray


def test_the_2x8_layout_loads_as_opd_train_with_replicas_and_vllm_beside_8_ranks():
    from opd.distill.config import TrainConfig

    cfg = load_yaml(EXAMPLE.with_name("train_2x8.yaml"), TrainConfig)
    assert (cfg.cluster.mode, cfg.cluster.student.num_workers, cfg.rollout.engine) == ("local", 8, "vllm")
    assert [(t.name, t.address, t.replicas) for t in cfg.merge.teachers] == [
        ("math", "tcp://10.0.0.9:5601", ["tcp://10.0.0.9:5602"]), ("code", "tcp://10.0.0.9:5611", ["tcp://10.0.0.9:5612"])]
    assert cfg.rollout.prompts_per_step % cfg.cluster.student.num_workers == 0


def test_bad_cluster_configs_are_refused():
    with pytest.raises(ConfigError, match="student.num_workers"):
        from_dict({"mode": "ray", "student": {"num_workers": 0}}, ClusterConfig)
    with pytest.raises(ConfigError, match="unknown key 'teachers\\[0\\].gpu'"):
        from_dict({"teachers": [{"name": "a", "model": "m", "gpu": 1}]}, ClusterConfig)
    with pytest.raises(ConfigError, match="unique"):
        from_dict({"teachers": [{"name": "a", "model": "m"}, {"name": "a", "model": "n"}]}, ClusterConfig)
    with pytest.raises(ValueError, match="mode: ray"):
        RayCluster.start(ClusterConfig())


def test_fork_mode_starts_one_server_per_teacher_and_only_for_opd_train():
    cfg = from_dict({"mode": "fork", "teachers": [{"name": "a", "model": "m", "serve_args": ["--max-k", "8"]}]},
                    ClusterConfig)
    assert cfg.teacher("a").server_args("tcp://127.0.0.1:*") == [
        "--model", "m", "--backend", "hf", "--name", "a", "--bind", "tcp://127.0.0.1:*", "--max-k", "8"]
    with pytest.raises(ConfigError, match="replicas: 1 for \\['a'\\]"):
        from_dict({"mode": "fork", "teachers": [{"name": "a", "model": "m", "replicas": 2}]}, ClusterConfig)
    from opd.rl.config import RLConfig
    with pytest.raises(ConfigError, match="opd rl has none"):
        from_dict({"model": {"path": "m"}, "data": {"train": "d"}, "cluster": {"mode": "fork"}}, RLConfig)


def test_fork_mode_gives_a_teacher_its_own_gpus():
    cfg = from_dict({"mode": "fork", "teachers": [{"name": "a", "model": "m", "gpus": [1, 2]},
                                                  {"name": "b", "model": "n"}]}, ClusterConfig)
    a, b = cfg.teacher("a"), cfg.teacher("b")
    assert a.server_env() == {"CUDA_VISIBLE_DEVICES": "1,2"} and b.server_env() == {}
    assert a.server_args("tcp://127.0.0.1:*")[-2:] == ["--device", "cuda"]
    assert "--device" not in b.server_args("tcp://127.0.0.1:*")
    with pytest.raises(ConfigError, match="gpus is for mode fork.*set num_gpus instead.*\\['a'\\]"):
        from_dict({"mode": "ray", "teachers": [{"name": "a", "model": "m", "gpus": [1]}]}, ClusterConfig)
    with pytest.raises(ConfigError, match="CUDA device indices.*\\('a', -1\\)"):
        from_dict({"mode": "fork", "teachers": [{"name": "a", "model": "m", "gpus": [-1]}]}, ClusterConfig)


def test_the_students_ranks_on_ray_are_configured_and_refused_with_their_key():
    cfg = from_dict({"mode": "ray", "student": {"num_workers": 2, "strategy": "STRICT_PACK",
                                                "num_gpus_per_worker": 1}}, ClusterConfig)
    assert cfg.ranks_on_ray and cfg.student.strategy == "STRICT_PACK" and cfg.student.num_cpus_per_worker == 1.0
    assert not from_dict({"mode": "ray"}, ClusterConfig).ranks_on_ray                  # one process: no ranks
    assert not from_dict({"student": {"num_workers": 2}}, ClusterConfig).ranks_on_ray   # torchrun's
    with pytest.raises(ConfigError, match="'student.strategy' expects one of"):
        from_dict({"mode": "ray", "student": {"num_workers": 2, "strategy": "TIGHT"}}, ClusterConfig)
    with pytest.raises(ConfigError, match="must reserve something"):
        from_dict({"student": {"num_cpus_per_worker": 0, "num_gpus_per_worker": 0}}, ClusterConfig)
    # Only rank 0 starts what cluster.mode starts: the other ranks would have no pool of these.
    with pytest.raises(ConfigError, match="cluster.teachers \\['a'\\] with the student's ranks on Ray"):
        from_dict({"mode": "ray", "student": {"num_workers": 2}, "teachers": [{"name": "a", "model": "m"}]},
                  ClusterConfig)


def test_ray_ranks_get_torchruns_variables_and_see_their_nodes_gpus():
    from opd.cluster.ranks import rank_envs

    cpu = rank_envs([{"node": "a", "ip": "10.0.0.1", "gpus": []}, {"node": "b", "ip": "10.0.0.2", "gpus": []},
                     {"node": "a", "ip": "10.0.0.1", "gpus": []}], master=("10.0.0.1", 29500))
    assert [(e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in cpu] == [("0", "0", "2"), ("1", "0", "1"),
                                                                                   ("2", "1", "2")]
    assert all(e["WORLD_SIZE"] == "3" and (e["MASTER_ADDR"], e["MASTER_PORT"]) == ("10.0.0.1", "29500")
               and "CUDA_VISIBLE_DEVICES" not in e for e in cpu)
    # Ray hands rank 0 GPU 3 and rank 1 GPU 1 of node a, and GPU 10 of node b to rank 2: each sees its
    # node's ranks' GPUs in order, and LOCAL_RANK indexes its own among them (cuda:LOCAL_RANK).
    gpu = rank_envs([{"node": "a", "ip": "x", "gpus": ["3"]}, {"node": "a", "ip": "x", "gpus": ["1"]},
                     {"node": "b", "ip": "y", "gpus": ["10"]}], master=("x", 1))
    assert [(e["CUDA_VISIBLE_DEVICES"], e["LOCAL_RANK"]) for e in gpu] == [("1,3", "1"), ("1,3", "0"), ("10", "0")]


def test_retired_keys_are_refused_saying_why():
    from opd.rl.config import RLConfig

    with pytest.raises(ConfigError, match="key 'algorithm.max_grad_norm' is no longer read here: it is "
                                          "optim.grad_clip now"):
        from_dict({"model": {"path": "m"}, "data": {"train": "t.jsonl"}, "algorithm": {"max_grad_norm": 1.0}},
                  RLConfig)


def test_a_trainer_that_forks_its_teachers_waits_passively_unless_the_user_chose(monkeypatch):
    from opd.cluster.cores import share_cores

    fork = from_dict({"mode": "fork", "teachers": [{"name": "t", "model": "m"}]}, ClusterConfig)
    monkeypatch.setenv("OMP_WAIT_POLICY", "")   # recorded first, so that teardown restores what was there
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert share_cores(from_dict({"mode": "local"}, ClusterConfig)).startswith("unset")
    assert "OMP_WAIT_POLICY" not in os.environ                     # teachers elsewhere: libgomp's default
    assert share_cores(fork).startswith("PASSIVE") and os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert share_cores(fork) == "ACTIVE" and os.environ["OMP_WAIT_POLICY"] == "ACTIVE"   # the user's stays
