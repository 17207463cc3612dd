"""Every accelerate config of `trl_tree/accelerate_configs/` loads in accelerate and says what its name promises."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.utils import DistributedType

CONFIGS = Path(__file__).resolve().parent.parent / "trl_tree" / "accelerate_configs"

# name -> (distributed type, processes, machines, use_cpu, mixed precision)
EXPECTED = {
    "single_gpu": (DistributedType.NO, 1, 1, False, "bf16"),
    "multi_gpu": (DistributedType.MULTI_GPU, 8, 1, False, "bf16"),
    "multi_node": (DistributedType.MULTI_GPU, 16, 2, False, "bf16"),
    "deepspeed_zero2": (DistributedType.DEEPSPEED, 8, 1, False, "bf16"),
    "deepspeed_zero3": (DistributedType.DEEPSPEED, 8, 1, False, "bf16"),
    "fsdp2": (DistributedType.FSDP, 8, 1, False, "bf16"),
    "multi_cpu": (DistributedType.MULTI_GPU, 2, 1, True, "no"),
}


def test_the_expected_configs_and_no_others_are_shipped():
    assert {p.stem for p in CONFIGS.glob("*.yaml")} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_loads_in_accelerate_with_its_promised_fields(name):
    config = load_config_from_file(str(CONFIGS / f"{name}.yaml"))
    assert isinstance(config, ClusterConfig)
    distributed_type, num_processes, num_machines, use_cpu, mixed_precision = EXPECTED[name]
    assert config.distributed_type == distributed_type
    assert config.num_processes == num_processes and config.num_machines == num_machines
    assert config.use_cpu is use_cpu
    assert config.mixed_precision == mixed_precision


@pytest.mark.parametrize(("name", "stage"), [("deepspeed_zero2", 2), ("deepspeed_zero3", 3)])
def test_deepspeed_configs_set_their_zero_stage(name, stage):
    config = load_config_from_file(str(CONFIGS / f"{name}.yaml"))
    assert config.deepspeed_config["zero_stage"] == stage
    # ZeRO-3 saves a gathered 16-bit model, so save_model writes weights eval_hotpot.py can load
    assert config.deepspeed_config.get("zero3_save_16bit_model", stage != 3) is True


def test_multi_node_config_names_the_main_machine_and_a_static_rendezvous():
    """What every machine's launch needs: the main machine's address and port, this machine's rank (0 in the file:
    the other machines give `--machine_rank` on the command line) and torchrun's static rendezvous. Launched on two
    simulated machines by tests/test_multi_machine.py."""
    config = load_config_from_file(str(CONFIGS / "multi_node.yaml"))
    assert config.main_process_ip and config.main_process_port and config.machine_rank == 0
    assert config.rdzv_backend == "static" and config.same_network is True
    assert config.num_processes % config.num_machines == 0  # processes per machine


def test_fsdp2_config_is_fsdp_version_2_with_full_state_dict():
    config = load_config_from_file(str(CONFIGS / "fsdp2.yaml"))
    assert config.fsdp_config["fsdp_version"] == 2
    assert config.fsdp_config["fsdp_state_dict_type"] == "FULL_STATE_DICT"


@pytest.mark.slow
def test_multi_cpu_config_starts_two_processes(tmp_path):
    """`--cpu --num_processes 2` silently runs one process; the multi_cpu config must really give a world of 2
    (to processes that ask for the CPU, as the trainers do with `use_cpu=True`)."""
    script = tmp_path / "world.py"
    script.write_text(
        textwrap.dedent(
            """
            from accelerate import Accelerator

            accelerator = Accelerator(cpu=True)  # what TrainingArguments(use_cpu=True) does in the trainer
            print(f"rank {accelerator.process_index} of {accelerator.num_processes}", flush=True)
            accelerator.end_training()
            """
        )
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(CONFIGS / "multi_cpu.yaml"),
            "--main_process_port",
            "29517",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    # two ranks share one pipe, so their lines can interleave: find the reports anywhere in the output
    assert sorted(re.findall(r"rank \d of \d", out.stdout)) == ["rank 0 of 2", "rank 1 of 2"]


def test_the_repositorys_top_level_accelerate_configs_are_the_packages_files():
    """TRL users launch with `--config_file accelerate_configs/NAME.yaml` from the repository: that folder is the
    package's (one source), not a copy that can drift."""
    top = CONFIGS.parent.parent / "accelerate_configs"
    assert top.resolve() == CONFIGS.resolve()
    assert {p.name for p in top.glob("*.yaml")} == {p.name for p in CONFIGS.glob("*.yaml")}
