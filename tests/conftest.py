"""Every test runs on 8 simulated CPU devices (set before jax is first imported).

Within one run, compiled programs are kept in JAX's persistent compilation cache, in a
temporary directory removed at the end: many tests build the same step for the same model and
config, and the subprocesses the suite starts (benchmark smoke runs, multi-process workers,
the docs snippets) inherit the directory through the environment. ZEROJAX_TEST_JIT_CACHE=0
turns it off; a directory given in JAX_COMPILATION_CACHE_DIR is used and kept.
"""
import gc
import os
import shutil
import sys
import tempfile

# Python keeps the bytecode of what it imports (__pycache__), for this run and the processes it
# starts, whatever PYTHONDONTWRITEBYTECODE says: with it set and packages installed without their
# bytecode (pip --no-compile), every process compiled jax, flax, orbax and zerojax from source
# again, about 5 s of CPU each (`import zerojax`: 7.4 s against 2.3 s with the bytecode kept),
# in every launched job's ranks, benchmark run and worker the suite starts (CI on two cores:
# 1923 s with the bytecode kept, 2194 s without)
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Most of the suite's cost is XLA's CPU compiler, and much of that is LLVM optimising code that
# runs for milliseconds. Tests compile without those optimisations (the quick tier on one worker:
# 208 s -> 163 s; every reference a test compares against is compiled the same way, and results
# stay bitwise equal where a test asks for it). XLA's older CPU loop emitters
# (--xla_cpu_use_fusion_emitters=false) compile about twice as fast again (test_step and
# test_sequence_parallel's quick tier: 54 -> 22 s of compiling, 46 -> 30 s wall; the full run on
# two workers about 19 minutes on a machine shared with another job, against 28 on CI before);
# two programs that compute the same thing may then round differently where they are fused
# differently, so parity tests between two zerojax programs hold roundings as roundings (SGD
# where Adam would amplify a near-zero gradient's last bit). Test runs only: benchmarks and
# users keep XLA's defaults. ZEROJAX_TEST_FAST_COMPILE=0 turns both off.
_FAST_COMPILE = ["--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"]
_SUITE_FLAGS = _FAST_COMPILE if os.environ.get("ZEROJAX_TEST_FAST_COMPILE", "1") != "0" else []

# Eight simulated devices share two cores with the other worker: under that load a thread can
# reach a collective's rendezvous late enough for XLA's CPU runtime to abort the process (its
# termination timeout), which took a worker down mid-run once (the sequence-parallel remat test).
# Tests give the runtime five minutes; a real deadlock still ends the process.
_SUITE_FLAGS = _SUITE_FLAGS + [f"--{f}=300" for f in ("xla_cpu_collective_call_terminate_timeout_seconds",
                                                      "xla_cpu_collective_timeout_seconds")]

# (set before anything imports jax, which reads them once)
_OWN_CACHE = None
if os.environ.get("ZEROJAX_TEST_JIT_CACHE", "1") != "0" and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="zerojax-test-jit-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
    # every program is worth keeping: the suite's programs are small and compile in well under a second
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# XLA:GPU's kernel cache (zerojax.tools._gpu.kernel_cache_file): most of an XLA:GPU compile of a
# small step is building its kernels, which the suite's steps for the same GPU share. One directory
# per process of the run (a pytest-xdist worker writes only its own) in the run's cache directory;
# the benchmark children a worker starts, and waits on, use the worker's.
_RUN_CACHE = os.environ.get("JAX_COMPILATION_CACHE_DIR")
if _RUN_CACHE and os.environ.get("ZEROJAX_GPU_KERNEL_CACHE", _RUN_CACHE).startswith(_RUN_CACHE):
    os.environ["ZEROJAX_GPU_KERNEL_CACHE"] = os.path.join(
        _RUN_CACHE, "gpu-kernels-" + os.environ.get("PYTEST_XDIST_WORKER", "main"))


# XLA aborts the process on a flag it does not know, and flags come and go between releases
# (jax 0.12's XLA has no --xla_cpu_use_fusion_emitters): only those this XLA knows are set. The
# run's first process tries them once (zerojax._compat.known_xla_flags) and leaves the known ones
# in ZEROJAX_TEST_XLA_FLAGS, where pytest-xdist's workers and the suite's children find them.
if "ZEROJAX_TEST_XLA_FLAGS" not in os.environ:
    from zerojax._compat import known_xla_flags

    os.environ["ZEROJAX_TEST_XLA_FLAGS"] = " ".join(known_xla_flags(dict.fromkeys(_FAST_COMPILE + _SUITE_FLAGS)))
    _known = os.environ["ZEROJAX_TEST_XLA_FLAGS"].split()
    for _flag in _SUITE_FLAGS:
        if _flag in _known and _flag.split("=", 1)[0].lstrip("-") not in os.environ["XLA_FLAGS"]:
            os.environ["XLA_FLAGS"] += " " + _flag


def pytest_collection_finish(session):
    # Python's cyclic collector: a worker's heap holds jax, the collected tests and every traced and
    # compiled program, and each full collection walked all of it again (0.4 s each, 35 in the
    # quick tier: 19 of its 627 CPU-s went to the collector). What is alive once the tests are
    # collected stays (frozen), and the young generations are collected less often.
    gc.collect()
    gc.freeze()
    gc.set_threshold(10000, 50, 100)


def pytest_configure(config):
    from tests._cost import CostProfile

    config.pluginmanager.register(CostProfile(BUDGET), "zerojax_cost")


def pytest_sessionfinish(session, exitstatus):
    # under pytest-xdist the workers share the controller's cache: only the controller removes it
    if _OWN_CACHE is not None and not hasattr(session.config, "workerinput"):
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


# --------------------------------------------------------------------------- the two tiers
# `pytest -m "not slow"` is the quick tier. A test is slow when it is marked in its file or listed
# here (file::name: every parametrisation of it, or all but the case id given beside why). What stays in the quick tier still
# touches every feature at small shapes: each file below keeps its cheaper tests (the quick tier
# keeps, e.g., every stage's accumulation-and-clipping parity, the config reader's own tests, the
# launcher's failure handling on plain scripts, plan_step in process).
SLOW = {
    # the quick tier's heaviest calls on an idle machine (--durations of `-m "not slow"`)
    "tests/stages/test_zeropp.py::test_compiled_collectives_follow_each_setting": "52 s, one compile per setting",
    "tests/stages/test_collectives.py::test_tied_table_larger_than_a_fetch_is_never_whole_and_matches_plain_sgd":
        "38 s and 32 s idle; 44 s and 38 s at load 5 (58 s and 49 s before its plain-SGD reference was jitted)",
    "tests/stages/test_collectives.py::test_tied_table_split_along_its_rows_is_sliced_too_and_matches_plain_sgd": "39 s",
    "tests/stages/test_zeropp.py::test_gpt_bf16_accumulation_all_three_tracks_stage3": "29 s and 27 s",
    "tests/test_plan.py::test_model_parallel_annotations_are_kept_and_training_matches":
        "8 s; test_flax_support keeps a model axis",
    "tests/test_initialize.py::test_example_configs_train_in_mixed_precision":
        "7 s a case; other initialize tests train from files",
    "tests/tools/test_planning.py::test_cli_plan_step_prints_the_plan":
        "7 s, child process; plan_step in process stays",
    "tests/stages/test_collectives.py::test_peak_memory_is_the_compiled_analysis":
        "6 s; test_planning checks compiled peaks",
    "tests/stages/test_zeropp.py::test_the_step_gathers_weights_only_for_their_uses":
        "6 s; qwZ's gradient test stays",
    "tests/test_initialize.py::test_mixed_precision_config_check_catches_an_update_without_master":
        "6 s a case",
    "tests/offload/test_zenflow.py::test_update_every_step_without_overlap_equals_plain_offloaded_adamw":
        "6 s; the numpy-reference test stays",
    "tests/stages/test_zeropp.py::test_offload_changes_nothing":
        "6 s",
    "tests/tools/test_planning.py::test_failing_child_raises_with_its_stderr":
        "5 s, child process",
    "tests/stages/test_quantize.py::test_leading_dims_are_kept_and_rows_independent":
        "5 s; the other quantizer tests stay",
    "tests/stages/test_collectives.py::test_scan_model_gathers_inside_the_layer_loop":
        "5 s a case",
    "tests/stages/test_zeropp.py::test_checkpoint_round_trip_holds_exact_values_and_resumes_bitwise":
        "5 s; checkpoint round trips stay",
    "tests/test_optim.py::test_optimizer_that_cannot_run_on_the_host_is_updated_on_the_device":
        "4 s",
    "tests/test_low_precision.py::test_checkpoint_round_trips_between_state_precisions":
        "4 s a case",
    "tests/stages/test_zeropp.py::test_all_three_within_the_bounds_with_accumulation":
        "4 s",
    "tests/stages/test_reuse_distance.py::test_numerics_match_plain_optax_whether_reused_or_gathered_again":
        "4 s a case",
    "tests/stages/test_collectives.py::test_lookup_moves_rows_not_the_table_when_fewer_rows_are_read":
        "3 s a case",
    "tests/stages/test_collectives.py::test_a_matmul_param_is_sliced_above_max_live_or_eight_prefetch_buckets":
        "3 s",
    "tests/stages/test_reduce_scatter.py::test_compiled_step_all_reduces_instead_of_reduce_scattering":
        "2.5 s a case; the numerics twin stays",
    "tests/models/test_classifier_task.py::test_pretrained_backbone_is_cached":
        "4 s",
    "tests/test_initialize.py::test_example_config_check_catches_an_inverted_clip_coefficient":
        "2.5 s",
    "tests/offload/test_offload_placement.py::test_bf16_host_update_tracks_on_device_update":
        "3 s",
    "tests/offload/test_offload_ratio.py::test_initialize_from_a_deepspeed_dict_with_ratio_trains":
        "2.6 s",
    # a fresh JAX process each, compiling every contender (199 s and 171 s before their smoke modes
    # shared compiled contenders)
    "tests/test_benchmarks.py::test_gpu_check_smoke_runs_every_section": "subprocess, many compiles",
    "tests/test_benchmarks.py::test_vs_plain_jax_smoke_prints_every_ratio_in_pairs": "subprocess, many compiles",
    "tests/test_benchmarks.py::test_compile_time_smoke_prints_ratios_slopes_recompiles_and_the_cache":
        "subprocesses, every contender compiled from nothing",
    "tests/test_benchmarks.py::test_compile_time_trace_smoke_prints_counts_and_the_slope_ratio":
        "a subprocess tracing each contender's step five times (9 s)",
    "tests/test_benchmarks.py::test_variadic_gather_smoke_reports_both_partitioners_and_an_equal_step":
        "three subprocesses, three contenders compiled twice each",
    "tests/test_benchmarks.py::test_bigger_than_memory_smoke_trains_and_prints_the_disk_figures":
        "a subprocess training ZeRO-Infinity's GPT, measuring the disk, saving and resuming (23 s idle)",
    "tests/test_benchmarks.py::test_muon_smoke_prints_every_contender": "a subprocess compiling sixteen contenders and the owner programs (17 s with eight)",
    # every stage x every optimizer against plain optax, 10 steps each: 32 compiled steps + references
    "tests/test_step.py::test_matches_plain_optax_fp32": "32 compiled steps",
    # 65 real DeepSpeed configs, each through zj.initialize and three steps
    "tests/config/test_ds_corpus.py::test_corpus_file": "65 compiled steps",
    # two launched processes of four devices (one launch shared by these checks)
    "tests/runtime/test_distributed.py::test_pair_is_two_processes_of_four_devices": "2-process launch",
    "tests/runtime/test_distributed.py::test_shard_batch_puts_each_process_rows_in_order": "2-process launch",
    "tests/runtime/test_distributed.py::test_two_processes_match_one_process": "2-process launch",
    "tests/runtime/test_distributed.py::test_memory_report_counts_every_process": "2-process launch",
    "tests/runtime/test_distributed.py::test_checkpoint_saved_by_one_process_restores_in_two": "2-process launch",
    "tests/runtime/test_distributed.py::test_checkpoint_saved_by_two_processes_restores_in_one": "2-process launch",
    "tests/runtime/test_distributed.py::test_consolidate_a_two_process_checkpoint": "2-process launch",
    "tests/runtime/test_distributed.py::test_uneven_rows_across_processes_is_an_error": "2-process launch",
    "tests/runtime/test_distributed.py::test_killed_worker_stops_the_launch": "2 JAX processes",
    "tests/runtime/test_distributed.py::test_unreachable_coordinator_fails_with_a_message": "JAX processes, timeouts",
    "tests/runtime/test_distributed.py::test_torchrun_environment_starts_two_real_processes": "2 JAX processes",
    "tests/runtime/test_distributed.py::test_torchrun_check_catches_a_start_up_that_ignores_torchrun": "2 JAX processes",
    # checkpoints written by killed or zerojax-free child processes
    "tests/checkpoint/test_checkpoint.py::test_killed_saves_leave_a_restorable_checkpoint": "child processes",
    "tests/checkpoint/test_checkpoint.py::test_killed_save_check_catches_a_restore_of_an_older_step": "child processes",
    "tests/checkpoint/test_checkpoint.py::test_plain_orbax_reads_a_checkpoint_on_one_device_without_zerojax":
        "child process",
    # autotune compiles every candidate of a search; plan_step for 16 devices starts a child
    "tests/tools/test_autotune.py::test_table_covers_every_candidate_and_fits_follow_compiled_peaks": "many compiles",
    "tests/tools/test_autotune.py::test_recommendation_fits_and_moves_when_the_budget_drops_below_it": "many compiles",
    "tests/tools/test_autotune.py::test_timed_mode_measures_real_steps_and_picks_the_fastest": "timed steps",
    "tests/test_tiled_loss.py::test_the_gradient_never_holds_the_whole_logits_on_xla_gpu":
        "two XLA:GPU compiles where JAX's CUDA plugin is installed (5 s on a loaded machine)",
    "tests/tools/test_autotune.py::test_a_target_compiles_every_candidate_with_xla_gpu_and_budgets_its_memory":
        "XLA:GPU compiles of the searched candidates where JAX's CUDA plugin is installed (15 s on a loaded machine)",
    "tests/tools/test_planning.py::test_subprocess_plans_more_devices_than_this_process_has": "child process",
    "tests/test_optim.py::test_donated_state_in_callers_jit": "child process per case",
    # from --durations of the full suite (seconds on a machine loaded 5-10x: a third to a tenth idle)
    "tests/stages/test_collectives.py::test_bucket_sizes_set_the_number_of_collectives":
        "5.5 s and 3.5 s at load 1.6 (44 s and 32 s at load 5-6 on the 3-layer GPT, before tests/helpers.py's model)",
    "tests/stages/test_collectives.py::test_reduce_once_per_step_in_stages_0_and_1_but_per_micro_batch_in_2":
        "7 s at load 1.6 (55 s at load 5-6 on the 3-layer GPT, before tests/helpers.py's model)",
    "tests/stages/test_collectives.py::test_collective_kinds_and_volume_per_stage":
        ("5 s, 5 s, 1 s, 5.5 s at load 2.5 (7, 7, 2, 8.6 s on the 3-layer GPT)", "1"),
    "tests/stages/test_collectives.py::test_stage3_gathers_per_micro_batch_and_again_for_backward_beyond_the_distance":
        ("11 s and 7 s at load 2.5 (18 s and 12 s on the 3-layer GPT)", "keep"),
    "tests/stages/test_collectives.py::test_stage3_issues_the_prefetched_gathers_as_one_collective": "56 s",
    "tests/stages/test_collectives.py::test_stage3_matches_plain_optax_for_every_model_kind":
        ("scan 8 s, fori_loop 4 s at load 4.6 (11 s and 4.4 s before the plain reference was jitted)", "python_loop"),
    "tests/offload/test_offload_placement.py::test_offloaded_optimizer_equals_plain_optax_for_every_optimizer":
        ("3-5 s a case at load 2-3 (250 s for 8 on a loaded machine)", "adamw"),
    "tests/offload/test_offload_placement.py::test_offloaded_state_in_host_memory_trains_like_on_device":
        ("76 s, 3 cases", "config0-device_parts0-pinned_host"),
    "tests/offload/test_offload_ratio.py::test_ratio_half_trains_like_full_offload_no_offload_and_plain_optax":
        ("8 s, 12 s, 9 s at load 2-3 (182 s on a loaded machine)", "fp32"),
    "tests/offload/test_offload_ratio.py::test_every_per_leaf_optimizer_splits":
        ("3-4.5 s a case at load 2-3 (181 s for 7 on a loaded machine)", "adamw"),
    "tests/offload/test_offload_ratio.py::test_checkpoint_moves_between_ratio_half_and_full_offload": "77 s",
    "tests/offload/test_offload_ratio.py::test_factored_adafactor_statistics_follow_their_param": "50 s",
    "tests/offload/test_zenflow.py::test_zenflow_follows_the_numpy_reference_step_by_step":
        ("6 s, 8 s, 8.4 s at load 2-3 (153 s on a loaded machine)", "sync"),
    "tests/offload/test_zenflow.py::test_staleness_bound":
        ("6.3 s, 1.4 s, 1.2 s at load 2-3, the cases sharing their programs (147 s on a loaded machine)", "False-3"),
    "tests/offload/test_zenflow.py::test_state_carries_only_params_and_checkpoints_round_trip": "95 s",
    "tests/offload/test_zenflow.py::test_all_columns_important_equals_plain_adamw": "73 s",
    "tests/offload/test_zenflow.py::test_selection_picks_the_rows_with_the_largest_gradient_l1_norms": "63 s",
    "tests/offload/test_zenflow.py::test_learning_rate_schedule_is_followed_on_device_and_host": "58 s",
    "tests/kernels/test_fused_adam.py::test_the_step_updates_with_the_fused_kernel_like_the_reference":
        ("5.8 s, 9.2 s, 4.1 s at load 2-3 (96 s on a loaded machine)", "3-fp32"),
    "tests/checkpoint/test_checkpoint.py::test_resume_is_bitwise_exact": ("60 s, 2 precisions", "fp32"),
    "tests/models/test_classifier_task.py::test_a_few_fine_tuning_steps_reduce_the_loss": "36 s",
    "tests/runtime/test_distributed.py::test_ctrl_c_reaches_every_rank": "28 s, 2 processes",
    # the quick tier's heaviest calls where another quick test covers the feature (full-run seconds
    # on two workers): the quick tier also runs in CI's newest environment, whose XLA compiles about
    # twice as slowly
    "tests/stages/test_peak.py::test_stage3_lean_peak_holds_a_few_layers_not_the_model":
        "19 s; test_collectives' stage-3 gather bounds stay",
    "tests/models/test_classifier_task.py::test_task_is_deterministic_balanced_and_disjoint":
        "10.5 s; the hand-made accuracy case stays",
    "tests/offload/test_nvme_params.py::test_nvme_params_are_read_where_the_gpt_uses_them":
        "8.7 s a case; the params-from-the-files tests stay",
    "tests/stages/test_pieces.py::test_the_stage1_step_compiles_fewer_kernels_than_with_constant_offsets":
        "8.2 s; the stage-1 lowering test stays",
    "tests/stages/test_stage3_trace.py::test_stage3_replay_linearizes_no_more_per_layer_than_plain_jit":
        "7.1 s a case; the inlined-program test stays",
    "tests/runtime/test_faults.py::test_sigterm_while_a_save_is_written_commits_it_and_saves_the_next":
        "7.5 s, two jobs; SIGTERM at a step stays",
    "tests/runtime/test_faults.py::test_sigterm_to_a_process_that_no_longer_trains_still_ends_it":
        "6.1 s, a job",
    "tests/runtime/test_faults.py::test_the_named_preemption_signal_saves_like_sigterm": "3.5 s, a job",
    "tests/test_docs.py::test_docs_build_strict": "4.7 s, mkdocs (no JAX)",
    "tests/config/test_muon.py::test_deepspeed_muon_trains_like_optax":
        "stage 1: 167 programs, 25 s on a loaded machine; stage 3: 20 s in the newest environment "
        "(tests/stages/test_muon.py's DeepSpeed Muon against optax at stage 1 stays, and the "
        "muon_params test reads the groups from a DeepSpeed file)",
    "tests/checkpoint/test_zenflow_checkpoint.py::test_checkpoints_move_between_zenflow_and_the_device_tier":
        "21 s on a loaded machine; the resumes of interval 2 and of an overlapped step stay",
    "tests/checkpoint/test_zenflow_checkpoint.py::test_warm_up_and_reselection_resume_between_reselections":
        "10 s on a loaded machine",
    "tests/checkpoint/test_zenflow_checkpoint.py::test_update_interval_auto_resumes_exactly": "10 s on a loaded machine",
    "tests/stages/test_muon.py::test_stacked_leaves_share_stacks_with_2d_ones_and_match_optax":
        "13 s under load (248 programs; 81 since its reference runs jitted); the 2-D owner tests stay",
    "tests/stages/test_muon.py::test_collectives_do_not_follow_the_iterations_and_bytes_stay_within_adamws_plus_the_muon_params":
        "13 s under load, a compile per iteration count",
    # the quick tier's heaviest calls in the newest environment (seconds there, idle, two workers)
    "tests/test_sequence_parallel.py::test_the_step_splits_the_sequence_and_all_to_alls":
        "10 s; the sequence-parallel GPT against plain optax stays",
    "tests/tools/test_gpu_plan.py::test_plain_fsdp_plans_the_same_model_split_on_its_largest_dims":
        "9.5 s; plan_step's own tests stay",
    "tests/checkpoint/test_checkpoint.py::test_checksums_summed_on_the_host_equal_the_programs":
        "8.3 s; every restore in the quick tier checks the checksums",
    "tests/test_step.py::test_init_fn_in_groups_equals_one_program": "7.2 s a case",
}


# --------------------------------------------------------------------------- the budget
# The files allowed over tests/_cost.py's FILE_LIMIT (60 s) in the full run, each with its reason.
# The cost profile printed at the end of every run marks any other file over 60 s, and any test over
# 20 s; it asserts nothing (the machines are noisy).
BUDGET = {
    # seconds are the full run's on an idle 2-core machine, two workers (`pytest -n 2`, 591 s wall,
    # 1494 tests; a second run on the same machine an hour later took 705 s, every file about 20%
    # slower); test_step (51 s) and test_sequence_parallel (38 s) left this table when they fell
    # under 60 s
    "tests/test_optimizer_table.py": "104 s: 145 cells, every optax optimizer against plain optax on every "
                                     "device path (587 programs, 392 more read from the run's cache)",
    "tests/stages/test_collectives.py": "81 s: 32 tests reading the collectives of compiled steps, stage x "
                                        "bucket x prefetch setting (377 programs)",
    "tests/stages/test_zeropp.py": "81 s: every ZeRO++ setting (qwZ, qgZ, hpZ) compiled and checked against "
                                   "stage 3 and plain optax (246 programs, GPT-sized: 51 s of compiling)",
    "tests/test_benchmarks.py": "115 s: six benchmark smoke runs (gpu_check, vs_plain_jax, compile_time and its "
                                "--trace, variadic_gather, bigger_than_memory), each a fresh process building every contender it times",
    "tests/test_pipeline.py": "51 s (66 s in the slower run): every pipeline schedule's program against plain "
                              "optax, and the pipeline benchmark's smoke run (18-22 s)",
    "tests/runtime/test_distributed.py": "53 s (62 s in the slower runs): 16 processes: a two-process run of 4 "
                                         "devices each shared by its tests, and the launcher's failure handling "
                                         "(a killed worker, a failing rank, Ctrl-C, torchrun's variables)",
    "tests/test_autotp.py": "62 s: Hugging Face GPT-2 and Llama trained under AutoTP at stages 1-3, and the "
                            "AutoTP benchmark's smoke run (21 s)",
    "tests/runtime/test_faults.py": "75 s idle, 160 s at load 8: 9 launched jobs of 1-2 processes (a stuck process "
                                    "with its 8 s deadline and a restart, SIGTERM at a step and during a save, each "
                                    "resumed) and the watchdog benchmark's smoke run",
    "tests/tools/test_gpu_plan.py": "XLA:GPU compiles where JAX's CUDA plugin is installed: small GPT steps, and "
                                    "stage 0 against lean stage 3 at the 12-layer findings shape (two compiles, "
                                    "40-60 s each); a few seconds without the plugin",
    "tests/stages/test_muon.py": "77 s at load 8: Muon on owners against optax at stages 1-3, with accumulation, "
                                 "stacked leaves and a compile per Newton-Schulz iteration count (994 programs; 473 "
                                 "since the optax references are shared); the balanced owners, the momentum share "
                                 "per device and zero_optimizer on owners",
}


# the directories whose parametrised tests run every case in the quick tier too, and the files that
# mark their slow cases themselves (the optimizer table's quick tier is its diagonal: each path once,
# each optimizer once)
QUICK_EVERY_CASE = ("tests/config/", "tests/test_optimizer_table.py")


def pytest_collection_modifyitems(config, items):
    import pytest

    seen = set()
    first_case = set()
    for item in items:
        name, _, param = item.nodeid.partition("[")
        entry = SLOW.get(name)
        if entry is None:
            # a parametrised test runs its first case in the quick tier and the rest in the full
            # run, except the config reader's (pure Python, milliseconds a case)
            if param and not name.startswith(QUICK_EVERY_CASE):
                if name in first_case:
                    item.add_marker(pytest.mark.slow)
                first_case.add(name)
            continue
        seen.add(name)
        # ("why", "case id"): every case is slow but that one, which keeps the test in the quick tier
        if isinstance(entry, tuple) and param.rstrip("]") == entry[1]:
            continue
        item.add_marker(pytest.mark.slow)
    collected_files = {item.nodeid.split("::", 1)[0] for item in items}
    whole_files = not any("::" in str(a) for a in config.args)
    stale = [n for n in SLOW if whole_files and n.split("::", 1)[0] in collected_files and n not in seen]
    if stale:  # a renamed or deleted test would silently leave the slow tier
        raise pytest.UsageError(f"tests/conftest.py SLOW names tests that do not exist: {stale}")
