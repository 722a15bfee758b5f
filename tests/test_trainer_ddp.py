"""Data-parallel training through torchrun: two CPU processes over gloo.

The two-process cycle must give the same weights as one process taking the same global
batches (DDP averages the gradients of each process's half batch).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flywheel.contract import ModelLineage
from flywheel.lm import load_policy
from flywheel.settings import Settings
from launcher.embedded import free_port
from model_registry import ModelRegistry
from simulator.lake_feedback import consent_events, simulate_feedback
from simulator.telemetry import write_events
from trainer.config import TrainerConfig
from trainer.data import load_selection
from trainer.loop import score_samples, train_policy
from trainer.scoring import scorer_for

PROMPTS = [
    "def add(a, b):\n    return",
    "import os\n",
    "for i in range(",
    "x = ",
    "print(",
    "while True:\n    ",
]


@pytest.fixture
def tsettings(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """`settings` on a copy of an already-migrated empty SQLite MLflow store (migrating takes ~8 s)."""
    template = tmp_path_factory.getbasetemp() / "mlflow-template.db"
    if not template.exists():
        ModelRegistry(settings.model_copy(update={"mlflow_tracking_uri": f"sqlite:///{template}"})).versions()
    shutil.copy(template, settings.mlflow_tracking_uri.removeprefix("sqlite:///"))
    return settings


@pytest.mark.slow
def test_two_gloo_processes_train_like_one_process_on_the_same_global_batches(
    tsettings: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    registry = ModelRegistry(tsettings)
    champion = registry.register(tiny_model_dir, ModelLineage(base="tiny"))
    registry.set_alias("champion", champion)
    write_events(tsettings, consent_events(["u0", "u1"]))
    torch.set_num_threads(1)
    policy = load_policy(tiny_model_dir)
    # Rewarded by the parity of the first sampled token: a mix of 0 and 1 whatever the tiny model's sampled
    # lengths (with the length as the reward, a library update once made every reward 0 and nothing trained).
    simulate_feedback(tsettings, policy, PROMPTS, lambda g: float(g.completion_token_ids[0] % 2 == 0),
                      model_version=champion, n=16, seed=7, users=("u0", "u1"))  # fmt: skip
    # Stored in float32: rounded to bfloat16, the weights would differ from one process's by a rounding step.
    per_process = {"batch_size": 4, "learning_rate": 1e-3, "loss_aggregation": "sequence", "epochs": 1,
                   "save_dtype": "float32"}  # fmt: skip
    config_path = tmp_path / "trainer.json"
    config_path.write_text(json.dumps(per_process))

    env = {
        **os.environ,
        "FLYWHEEL_DATA_DIR": str(tsettings.data_dir),
        "MLFLOW_TRACKING_URI": tsettings.mlflow_tracking_uri,
        "REDIS_URL": tsettings.redis_url,
        "FLYWHEEL_REDIS_PREFIX": tsettings.redis_prefix,
        "FLYWHEEL_MIN_TRAIN_SAMPLES": "4",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "launcher", "trainer", "run-once",
           "--config", str(config_path)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    versions = registry.versions()
    assert len(versions) == 2, done.stdout[-2000:]
    candidate = versions[0]
    assert candidate.lineage.sample_count == 16 and candidate.lineage.parent_version == champion

    # One process, global batch 8 = 2 processes x 4, same order and seed.
    config = TrainerConfig(**{**per_process, "batch_size": 8})
    samples = load_selection(tsettings, config, watermark=None, quarantined=set(),
                             encode_prompt=lambda t: policy.encode_prompt(t, 1)).samples  # fmt: skip
    assert {s.reward for s in samples} == {0.0, 1.0}, "every reward alike: there is nothing to learn"
    scorer = scorer_for(config.exact_logprobs)
    start = {k: v.clone() for k, v in policy.model.state_dict().items()}
    reference = score_samples(policy.model, samples, scorer, policy.pad_id, 8)
    train_policy(policy.model, samples, reference, config, scorer, policy.pad_id)
    single = policy.model.state_dict()
    ddp = load_file(str(registry.fetch(candidate.version) / "model.safetensors"))
    moved = max(float((single[k] - start[k]).abs().max()) for k in ddp)
    apart = max(float((single[k] - ddp[k]).abs().max()) for k in ddp)
    assert moved > 1e-4, "training changed nothing"
    assert apart < 0.05 * moved, (
        f"two-process weights differ from one-process ones by {apart} (moved {moved})"
    )
