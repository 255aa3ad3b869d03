#!/usr/bin/env bash
# Lint (ruff) and run the whole test suite (CPU, gloo; see README, Tests, for its time); skip
# reasons are shown. Sets up .venv first if needed.
#   --fast  (first argument) only the FAST subset below, the loop developers run: every subsystem
#           (CLI and config, docs and code shape, models, TP, ZeRO 0-3, activation checkpointing,
#           checkpoints and exact resume, data, the end-to-end job under torchrun, HF import,
#           planner, FLOPs, schedule, golden losses, the launcher and pre-flight checks), each by
#           its cheapest test that runs it for real; the multi-rank suites that repeat a check
#           across layouts are left to the full run. About 140 CPU-seconds (see README, Tests).
#   VENV    which environment (default .venv); extra arguments go to pytest.
#   PYTEST_WORKERS  pytest-xdist workers (default 2; 0 runs in pytest's own process). Each
#           worker takes whole test files (--dist loadfile), so a file's spawned world is
#           built once; the launcher, signal and wandb tests wait on their children a third of
#           their time, which the other worker fills.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
V=${VENV:-$ROOT/.venv}
FAST=(
    tests/test_config.py::test_derived_batch_arithmetic tests/test_config.py::test_preset_with_overrides
    tests/test_config.py::test_each_bad_setting_names_its_values
    tests/test_config.py::test_bad_yaml_and_dry_run_flags_are_one_line_errors
    tests/test_config.py::test_config_file_yaml_and_toml
    tests/test_config.py::test_main_returns_2_without_touching_torch_distributed
    tests/test_config.py::test_component_configs_are_the_sections_and_flags_keep_megatron_names
    tests/test_docs.py tests/test_code_shape.py tests/test_imports.py
    tests/test_models.py tests/test_llama_model.py tests/test_tp.py tests/test_golden_losses.py
    tests/test_zero.py::test_parity_tp1_dp2
    tests/test_zero.py::test_layout_covers_every_element_once_with_padding
    tests/test_zero.py::test_loss_scaler_state_machine
    tests/test_activation_config.py tests/test_activations.py::test_paper_formula_reproduces_table2
    tests/test_offload.py::test_offloaded_checkpoints_reuse_host_buffers_prefetch_and_give_the_same_grads
    tests/test_checkpoint_fragments.py
    tests/test_checkpoint.py::test_exact_resume_tp1_dp2_accumulation_4
    tests/test_checkpoint.py::test_incomplete_checkpoint_is_never_loaded
    tests/test_data_indexed.py tests/test_data_gpt_dataset.py tests/test_data_preprocess.py
    tests/test_data_loader.py::test_ranks_get_disjoint_slices_and_equal_counts
    tests/test_data_loader.py::test_loader_batches_resume_and_tp_copies
    tests/test_pretrain.py::test_cli_end_to_end_tp2_dp2_zero2_with_offline_wandb
    tests/test_hf.py::test_gpt2_weights_give_our_logits_and_convert_back_bitwise
    tests/test_hf.py::test_init_from_hf_is_checked_before_any_process_group
    tests/test_plan.py tests/test_flops.py tests/test_schedule.py tests/test_training_loop.py
    tests/test_launch.py::test_a_bad_flag_under_the_launcher_is_one_line_before_any_rank_starts
    tests/test_preflight.py::test_every_unwritable_output_path_is_refused_naming_it_and_its_flag
)
if [ "${1:-}" = "--fast" ]; then
    shift
    set -- "${FAST[@]}" "$@"
fi
[ -x "$V/bin/pytest" ] || VENV=$V bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} WANDB_MODE=${WANDB_MODE:-offline}
"$V/bin/ruff" check .
W=${PYTEST_WORKERS:-2}
if [ "$W" = 0 ]; then
    exec "$V/bin/python" -m pytest -q -rs "$@"
fi
exec "$V/bin/python" -m pytest -q -rs -n "$W" --dist loadfile "$@"
