"""Deliberate breaks of torchpre's core mechanisms, one at a time, each against the fast tests that must catch it.

    python scripts/mutation_check.py            # every break; exit 1 if any survives
    python scripts/mutation_check.py -k zero    # the breaks whose name contains "zero"

Each break replaces one exact piece of source text (which must occur exactly once, or the script stops naming
it) in a temporary copy of the repository, runs its test subset there (PYTHONPATH points at the copy), and
reports whether the tests failed (caught, with pytest's first failure line) or passed (survived), with the time.
First the same tests run on an unbroken copy: they must pass. `python -m pytest -m mutation` runs the check too.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CORE = "tests/distributed/test_core_mechanisms.py"
GRAD_BUCKETS = "torchpre/parallel/grad_buckets.py"
GRAD_BUCKETS_TEST = "tests/distributed/test_grad_buckets.py"
ZERO_COLLECTIVES = "tests/distributed/test_zero_collectives.py"
TENSOR_PARALLEL = "tests/distributed/test_tensor_parallel.py::test_tensor_parallel_matches_single_process"
TP_GRAD_NORM = "tests/distributed/test_tensor_parallel_grad_norm.py"
# On torch 2.14 a single-stage schedule rescales gradients only on FSDP modules (`perform_reduce_grad`).
FSDP_PIPELINE_TEST = "tests/distributed/test_zero3_parity.py::test_zero3_gives_zero0_losses[dp2_pp2_1f1b_tied]"
RANK_CHUNK_TEST = "tests/unit/test_chunk_layout.py::test_rank_chunk_is_torch_chunk_of_that_rank"
CHECKPOINT = "tests/unit/test_checkpoint_integrity.py"
TRUST_TEST = "tests/unit/test_checkpoint_trust.py"
BINDING_TEST = "tests/unit/test_checkpoint_binding.py"
RUN_FOLDER_WRITES = "tests/unit/test_run_folder_writes.py"
PICKLED_TEST = "tests/unit/test_pickled.py"
METADATA_TEST = "tests/unit/test_checkpoint_metadata.py"
BAD_INPUT = "tests/integration/test_bad_input.py"
BAD_INPUT_CASE = f"{BAD_INPUT}::test_bad_input_fails_fast_with_one_message"
FOREIGN = "tests/unit/test_foreign_inputs.py"
MANIFEST_TEST = f"{CHECKPOINT}::test_the_manifest_records_every_file"
PUBLICATION_TEST = (
    "tests/unit/test_checkpoint_publication.py::"
    "test_an_async_save_is_published_when_its_write_is_done_not_before_and_not_at_the_next_save"
)
MANY_SHARDS_TEST = (
    "tests/unit/test_shard_data.py::"
    "test_thousands_of_shards_are_read_through_one_folder_descriptor_and_a_bounded_few_of_their_own"
)
FEISTEL_TEST = (
    "tests/unit/test_data.py::test_the_feistel_order_visits_each_sample_once_per_epoch_in_an_order_drawn_anew"
)
SPLIT_PREPARE_TEST = (
    "tests/unit/test_prepare.py::test_prepare_split_over_tasks_then_merged_is_byte_identical_to_one_task"
)
OLD_ORDER_TEST = (
    "tests/unit/test_data.py::test_a_checkpoint_without_an_order_version_resumes_in_the_first_order_and_saves_it_on"
)
DATA_POSITION_TEST = "tests/unit/test_data.py::test_a_resumed_data_position_gives_the_batches_training_would_have_read"
RNG_TEST = "tests/unit/test_checkpoint_rng.py"
SNAPSHOTS_TEST = "tests/distributed/test_snapshots.py"
SNAPSHOT_FILE_TEST = "tests/unit/test_snapshot_file.py"
LOSS_TEST = "tests/unit/test_trainer_loss.py"
HF_MODELS = "tests/integration/test_hf_models.py"
FSDP = "tests/distributed/test_fsdp.py"
FORENSICS_TEST = (
    "tests/integration/test_observability.py::test_forensics_name_the_block_whose_output_went_inf_and_leave_training_as_it_was"
)
FORENSICS_DP_TEST = (
    "tests/integration/test_observability.py::test_forensics_under_data_parallel_end_the_replays_gradient_reductions"
)
READ_LATE_SKIP_TEST = (
    "tests/integration/test_observability.py::"
    "test_steps_skipped_on_the_device_and_read_late_leave_the_parameters_bitwise_unchanged"
)
READ_LATE_STOP_TEST = (
    "tests/integration/test_observability.py::"
    "test_non_finite_step_stops_every_rank_after_saving_the_last_good_state[read-during-the-next]"
)
CP_ATTENTION = "tests/distributed/test_context_parallel_attention.py"
PUBLISHED_TEST = "tests/unit/test_published_calibration.py"
LINEAR_CROSS_ENTROPY = "tests/unit/test_linear_cross_entropy.py"
CP_MODEL = "tests/distributed/test_context_parallel_model.py"
HF_EXPORT_EVAL = "tests/integration/test_hf_export_eval.py"
HF_PARITY = "tests/unit/test_hf_folder_parity.py"
HF_MEMORY = "tests/integration/test_hf_import_memory.py::test_each_rank_reads_and_keeps_only_the_shards_it_holds"
OPTIMIZER_MATRIX = "tests/distributed/test_optimizers.py::test_zero_layout_matches_one_process"
DEEPSEEK_V3_MLA_TEST = "tests/unit/test_deepseek_v3.py::test_mla_alone_equals_transformers_attention"
DEEPSEEK_V3_CACHE_TEST = (
    "tests/unit/test_deepseek_v3.py::test_generation_with_the_latent_cache_equals_decoding_without_a_cache[query-latent]"
)
ZBV_MTP_TEST = (
    "tests/integration/test_moe.py::test_deepseek_v3_with_mtp_under_every_pipeline_schedule_matches_one_process"
    "[ZBVZeroBubble]"
)
RAMP_TRAINING_TEST = "tests/unit/test_ramp_training.py"
SLURM_SCRIPT_TEST = "tests/unit/test_slurm_script.py"
STOP_READ_LATE_TEST = (
    "tests/integration/test_faults.py::"
    "test_a_stop_request_read_late_stops_every_rank_one_step_later_and_resumes_exactly"
)
STEP_PLAN_TEST = "tests/unit/test_step_plan.py"
PARITY = "tests/distributed/test_parallel_parity.py"
MUP_UNIT = "tests/unit/test_parametrization.py"
GELU_UNIT = "tests/unit/test_gelu_mlp.py"
GELU_REFERENCE = f"{GELU_UNIT}::test_a_gelu_model_trains_as_one_with_hand_written_gpt_mlps"
MUP_INTEGRATION = "tests/integration/test_mup.py"
MIXED_PRECISION_TEST = (
    "tests/unit/test_mixed_precision.py::test_fp32_accumulation_tracks_fp32_more_closely_than_bf16_accumulation"
)
HF_TOKENIZER = "torchpre/data/hf_tokenizer.py"
HF_TOKENIZER_TEST = "tests/unit/test_hf_tokenizer.py"
HF_TOKENIZER_IDS_TEST = f"{HF_TOKENIZER_TEST}::test_ids_equal_transformers_on_a_mixed_corpus"
PREPARE_HF_TEST = (
    "tests/unit/test_prepare.py::"
    "test_a_hugging_face_tokenizer_prepares_transformers_ids_framed_as_its_family_and_ties_its_hash"
)
RELEASED_TOKENIZER = "tests/integration/test_released_tokenizer.py"
HF_IMPORT_TIED = (
    "tests/integration/test_hf_import.py::"
    "test_a_tied_deepseek_v3_config_beside_an_lm_head_of_its_own_is_refused_on_every_layout"
)


@dataclass(frozen=True)
class Break:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    breaks: str


BREAKS = [
    Break("dp-all-reduce-skipped", GRAD_BUCKETS,
          "            bucket.work = all_reduce_flat(bucket.sent, bucket.group, async_op=True)",
          "            bucket.work = None",
          (CORE,), "ZeRO-0 skips the DP gradient all-reduce"),
    Break("dp-reduce-scatter-without-sum", "torchpre/distributed/collectives.py",
          "    return _reduce_scatter_single(out, flat, group=group, async_op=async_op)",
          "    out.copy_(flat.view(dist.get_world_size(group), -1)[dist.get_rank(group)])\n"
          "    return dist.barrier(group=group, async_op=async_op)",
          (ZERO_COLLECTIVES, CORE), "ZeRO-1 and 2 take their own chunk without summing the other ranks'"),
    Break("zero2-shard-accumulation-dropped", GRAD_BUCKETS,
          "            bucket.shard.add_(self._own_section(bucket, sent))",
          "            bucket.shard.copy_(self._own_section(bucket, sent))",
          (CORE,), "ZeRO-2's gradient shard keeps only the last microbatch's reduce-scatter"),
    Break("bucket-late-gradient-ignored", GRAD_BUCKETS,
          "        if bucket.launched:\n            raise RuntimeError(",
          "        if False:\n            raise RuntimeError(",
          (GRAD_BUCKETS_TEST,), "a gradient reaching a bucket whose reduction started is silently lost"),
    Break("tied-gradient-sum-dropped", "torchpre/parallel/pipeline.py",
          "        total = mine + theirs if name == tied[0] else theirs + mine", "        total = mine",
          (CORE,), "a weight tied across stages keeps its stage's gradient only"),
    Break("tie-detection-skipped", "torchpre/parallel/ties.py",
          "    groups = [list(group) for group in shared_parameters(model)]", "    groups = []",
          ("tests/unit/test_ties.py",
           "tests/distributed/test_hf_parallelize_api.py::"
           "test_the_api_keeps_a_transformers_models_tied_embeddings_tied_at_dp2"),
          "parallelize finds no shared Parameter on the model as given: to_empty unties a tied transformers model"),
    Break("eval-window-off-by-one", "torchpre/evaluation/multiple_choice.py",
          "rows.append(Row((context + continuation)[-(max_length + 1) :], len(continuation)))",
          "rows.append(Row((context + continuation)[-max_length:], len(continuation)))",
          ("tests/unit/test_multiple_choice.py::test_the_window_of_a_long_context_is_lm_evaluation_harness_s_max_length",),
          "a long multiple-choice row keeps one token fewer than lm-evaluation-harness's window of max_length"),
    Break("leaked-process-group-kept", "tests/conftest.py",
          "    if dist is not None and dist.is_available() and dist.is_initialized():",
          "    if False:",
          ("tests/test_conftest.py",),
          "a test that leaves the default process group initialized takes every later test of its worker down"),
    Break("peer-exit-ignores-joined-ranks", "torchpre/distributed/peer_exit.py",
          "            settled = failed if joined else failed + store.add(_key(\"joined\"), 0)",
          "            settled = failed",
          ("tests/unit/test_peer_exit.py",),
          "a rank that failed before the process group waits its whole bound for a peer that passed the checks"),
    Break("quantize-keys-without-a-format-accepted", "torchpre/assembly/silent_keys.py",
          "    _check_quantize_format(config.quantize)\n", "",
          ("tests/integration/test_bad_input.py::test_bad_input_fails_fast_with_one_message[quantize-recipe-without-a-format]",),
          "quantize.recipe set with quantize.linear = 'none' trains in full precision without a word"),
    Break("unwritable-folder-accepted", "torchpre/config/validate.py",
          "        with tempfile.TemporaryFile(dir=existing):\n            pass",
          "        pass",
          ("tests/integration/test_bad_input.py::test_bad_input_fails_fast_with_one_message[hf-export-folder-not-writable]",),
          "an hf_export folder the job cannot write in is found at the first export, with a traceback"),
    Break("hf-conditions-without-scalars", "torchpre/models/hf/layouts.py",
          "    for key, value in _forward_scalars(model):", "    for key, value in []:",
          ("tests/integration/test_hf_support_table.py::test_the_committed_row_is_what_torchpre_decides_today[granite]",),
          "the support table's conditions leave out Granite's embedding_multiplier, which pp2 depends on"),
    Break("tie-placements-unchecked", "torchpre/parallel/api.py",
          "            check_tied_placements(part, ties)\n", "",
          ("tests/unit/test_ties.py::test_a_tensor_parallel_plan_sharding_one_copy_only_is_refused_by_name",),
          "a tensor-parallel plan sharding one copy of a tied weight and not the other is accepted"),
    Break("zero-shard-offset", "torchpre/parallel/data_parallel.py",
          "shard = rank_chunk(local, dim, dist.get_world_size(group), dist.get_rank(group))",
          "shard = rank_chunk(local, dim, dist.get_world_size(group), 0)",
          (CORE,), "every ZeRO-1 rank's master is the first chunk"),
    Break("zero-chunk-start", "torchpre/distributed/collectives.py",
          "    start = min(rank * per_chunk, tensor.shape[dim])",
          "    start = min(rank * per_chunk - rank, tensor.shape[dim])",
          (RANK_CHUNK_TEST,), "chunks overlap: the rank offset is one row short per rank"),
    Break("zero-all-gather-skipped", "torchpre/distributed/collectives.py",
          "    layout.unpack_all(gathered, outputs)", "    pass",
          (CORE,), "updated parameters are not all-gathered: each rank sees only its own chunk's update"),
    Break("loss-local-token-count", "torchpre/training/loss.py",
          "return self.cross_entropy_sum(logits_of(output), labels) / self.tokens_per_step",
          "return self.cross_entropy_sum(logits_of(output), labels) / labels.numel()",
          (LOSS_TEST,), "the loss is divided by the microbatch's tokens instead of the global batch's"),
    Break("checkpoint-data-position-off-by-one", "torchpre/data/loader.py",
          '        return {"consumed_samples": self.consumed_samples, "order_version": self.order_version}',
          '        return {"consumed_samples": self.consumed_samples + 1, "order_version": self.order_version}',
          (DATA_POSITION_TEST,), "the saved data position is one sample late"),
    Break("checkpoint-rng-not-restored", "torchpre/checkpoint/state.py",
          '            torch.set_rng_state(state_dict[f"rank{self.rank}"])', "            pass",
          (RNG_TEST,), "a resume keeps the generators' current state"),
    Break("checkpoint-manifest-skips-a-file", "torchpre/checkpoint/manager.py",
          "            files = {name: record for part, _, _ in parts for name, record in part.items()}",
          "            files = dict(list({n: r for part, _, _ in parts for n, r in part.items()}.items())[1:])",
          (MANIFEST_TEST,), "the manifest omits one file"),
    Break("checkpoint-published-before-written", "torchpre/checkpoint/manager.py",
          "            write.result()\n", "            pass\n",
          (PUBLICATION_TEST,), "an async save gets its manifest and its step-N name before its write is done"),
    Break("sp-norm-gradient-not-reduced", "torchpre/parallel/tensor_parallel.py",
          "            return grad.to_local(), True", "            return grad.to_local(), False",
          (TENSOR_PARALLEL,), "norm gradients under sequence parallel stay per-rank partial sums"),
    Break("clip-local-norm", "torchpre/optim/distributed_optimizer.py",
          "            dp_group=self.groups.dp if sharded_over_dp else None,", "            dp_group=None,",
          (CORE,), "ZeRO-1 clips with its shard's norm instead of the global one"),
    Break("clip-tp-shards-not-summed", "torchpre/parallel/grad_clip.py",
          "        dist.all_reduce(sharded, group=tp_group)", "        pass",
          (TP_GRAD_NORM,), "the norm of TP-sharded gradients is this rank's part only"),
    Break("sp-rope-positions-local", "torchpre/models/llama3/parallelize.py",
          "input_layouts=(residual, None), desired_input_layouts=(Replicate(), None)",
          "input_layouts=(residual, None), desired_input_layouts=(residual, None)",
          (TENSOR_PARALLEL,), "under SP attention sees its sequence slice: RoPE positions restart at 0 per rank"),
    Break("sp-save-shard-keeps-gathered", "torchpre/parallel/sequence_gather.py",
          "        if local.untyped_storage()._cdata != self.storage:", "        if True:",
          (TENSOR_PARALLEL,), "sequence_parallel_save_shard saves the gathered input after all: no memory saved"),
    Break("sp-save-shard-regathers-own-shard", "torchpre/parallel/sequence_gather.py",
          "        return shard.redistribute(self.mesh, [Replicate()]).to_local()",
          "        return torch.cat([self.shard] * self.mesh.size(), dim=self.sequence_dim)",
          (TENSOR_PARALLEL,), "backward's gather repeats this rank's shard: wrong weight gradients"),
    Break("ep-dispatch-splits-swapped", "torchpre/parallel/expert_parallel.py",
          "    received = funcol.all_to_all_single_autograd(tokens, recv_splits, send_splits, group)",
          "    received = funcol.all_to_all_single_autograd(tokens, send_splits, recv_splits, group)",
          (CORE,), "the EP dispatch all-to-all swaps its split sizes"),
    Break("ep-combine-splits-swapped", "torchpre/parallel/expert_parallel.py",
          "        received_order, dispatch.send_splits, dispatch.recv_splits, mesh.get_group()",
          "        received_order, dispatch.recv_splits, dispatch.send_splits, mesh.get_group()",
          (CORE,), "the EP combine all-to-all swaps its split sizes"),
    Break("pipeline-scaling-by-microbatches", "torchpre/parallel/pipeline.py",
          "    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)",
          "    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)",
          (FSDP_PIPELINE_TEST,), "single-stage schedules divide gradients by the microbatch count a second time"),
    Break("nonfinite-verdict-per-rank", "torchpre/health/verdict.py",
          "        dist.all_reduce(values)\n",
          "        dist.all_reduce(values[:1])\n",
          (CORE,), "each rank decides on its own flags whether to apply the step"),
    Break("update-read-late-applied-unconditionally", "torchpre/health/guard.py",
          "            self.optimizer.apply(skip=verdict.skip)\n",
          "            self.optimizer.apply()\n",
          (READ_LATE_SKIP_TEST,), "a fused step whose verdict is read late is applied even when not finite"),
    Break("stop-read-late-saves-the-later-data-position", "torchpre/training/trainer.py",
          "        self.job.progress.step, self.job.data.consumed_samples = step.number - 1, step.first_sample\n",
          "        self.job.progress.step = step.number - 1\n",
          (READ_LATE_STOP_TEST,), "a non-finite step read late saves the data position of the step after it"),
    Break("nonfinite-norm-verdict-per-rank", "torchpre/health/verdict.py",
          "            (~torch.isfinite(grad_norm)).float(),",
          "            (~torch.isfinite(grad_norm)).float() * dist.get_rank(),",
          (CORE,), "only rank 1's view of the norm counts"),
    Break("nonfinite-replay-leaves-reduction-state", "torchpre/training/trainer.py",
          "        self.job.reduction.reduce()\n        self.job.guard.optimizer.discard()",
          "        self.job.guard.optimizer.discard()",
          (FORENSICS_DP_TEST,), "the forensic replay's gradients are dropped without ending their bucket reductions"),
    Break("comm-all-to-all-counted-as-dp", "torchpre/distributed/comm_timer.py",
          '        if "ep" in kinds and collective.startswith("all_to_all"):',
          '        if "ep" in kinds and collective.startswith("all_to_all_of_nothing"):',
          ("tests/distributed/test_comm_timer.py",), "expert parallelism's all-to-all counts as dp's time"),
    Break("comm-timed-work-not-a-work", "torchpre/distributed/comm_timer.py",
          "class _TimedWork(dist.Work):", "class _TimedWork:",
          ("tests/distributed/test_comm_timer.py::test_fsdp_waits_for_a_timed_asynchronous_all_gather",
           "tests/distributed/test_parallel_parity.py::test_layout_matches_one_process[dp2_pp2_zero3_interleaved1f1b]"),
          "FSDP skips the wait of a timed async all-gather, so a schedule's prefetched stage computes with garbage"),
    Break("bubble-against-each-ranks-own-window", "torchpre/metrics/rank_times.py",
          "    window = max(windows)",
          "    window = min(windows)",
          ("tests/unit/test_rank_times.py",), "a rank that ends early is not idle for the rest of the step"),
    Break("straggler-busy-includes-waiting", "torchpre/metrics/recorder.py",
          '            busy=step_time - comm_seconds["total"],',
          "            busy=step_time,",
          ("tests/integration/test_rank_metrics.py::test_a_slowed_rank_is_named_and_an_even_run_raises_no_warning",),
          "a rank's busy time includes its waits for the straggler, so all ranks look alike"),
    Break("nonfinite-backward-finding-wins", "torchpre/health/forensics.py",
          "return (self.phase != FORWARD, self.microbatch, stage, self.rank)",
          "return (self.phase == FORWARD, self.microbatch, stage, self.rank)",
          ("tests/unit/test_nonfinite.py",), "an inherited backward finding is reported over the forward origin"),
    Break("adamw-decays-norm-gains", "torchpre/optim/distributed_optimizer.py",
          "self._group(0.0, whole_matrices,", "self._group(weight_decay, whole_matrices,",
          (CORE,), "biases and norm gains are weight-decayed"),
    Break("bf16-accumulation-not-fp32", GRAD_BUCKETS,
          "    if accumulate_in_fp32:", "    if False:",
          (MIXED_PRECISION_TEST,), "bf16 microbatch gradients are summed in bf16"),
    Break("causal-mask-dropped", "torchpre/models/attention.py",
          "    return sdpa(q, k, v, mask=None, is_causal=True)", "    return sdpa(q, k, v, mask=None, is_causal=False)",
          ("tests/unit/test_model.py::test_causal",), "attention sees future tokens"),
    Break("dp-data-slice", "torchpre/data/sampler.py",
          "        start = self.consumed_samples + self.dp_rank * self.local_batch_size",
          "        start = self.consumed_samples",
          ("tests/unit/test_data.py::test_dp_slices_concatenate_to_the_single_process_global_batch",),
          "every DP rank reads the same slice of the global batch"),
    Break("fsdp-gradient-divided-by-dp", "torchpre/parallel/data_parallel.py",
          "    module.set_gradient_divide_factor(1.0)", "    pass",
          (FSDP,), "ZeRO-3 keeps FSDP's default division of the gradients by dp (the loss is already global)"),
    Break("fsdp-sublayers-not-wrapped", "torchpre/parallel/data_parallel.py",
          "        sharded += [fully_shard(sublayer, mesh=dp_mesh, **options) for sublayer in _sublayers(block, "
          "plan.sublayers)]", "        pass",
          ("tests/distributed/test_fsdp_sublayer.py",),
          "parallelism.fsdp_wrap = 'sublayer' still gathers whole blocks: two at the peak, not one"),
    Break("fsdp-sublayer-key-ignored", "torchpre/assembly/plans.py",
          '        sublayers=sublayers if p.fsdp_wrap == "sublayer" else (),', "        sublayers=(),",
          ("tests/unit/test_zero_config.py::test_fsdp_units_per_sublayer_are_the_familys",),
          "the job never hands FSDP the family's sub-layers"),
    Break("plan-sublayer-gathers-two-blocks", "torchpre/planner/dryrun.py",
          '    return 1 if config.parallelism.fsdp_wrap == "sublayer" else 2', "    return 2",
          ("tests/unit/test_plan.py::test_the_planner_prices_fsdp_units_per_sublayer_as_the_dry_run",),
          "the planner and the dry run price units per sub-layer as two gathered blocks, as units per block"),
    Break("plan-fsdp-units-one-collective", "torchpre/planner/time_model.py",
          "        return units * once(op, nbytes / units)", "        return once(op, nbytes)",
          ("tests/unit/test_time_model.py::test_zero3_units_per_sublayer_cost_three_collectives_a_block",),
          "the time model prices units per sub-layer as one collective a block"),
    Break("owns-master-by-pointer", "torchpre/optim/distributed_optimizer.py",
          "        return self.masters[i].dtype != self.params[i].local.dtype",
          "        return (self.masters[i].untyped_storage().data_ptr()\n"
          "                != self.params[i].local.untyped_storage().data_ptr())",
          ("tests/unit/test_dryrun.py",), "bf16 masters on meta (pointer 0) are not counted as optimizer state"),
    Break("dry-run-in-flight-one", "torchpre/planner/dryrun.py",
          "    return round(held_peak(pipeline.schedule.name, pipeline.pp, n_microbatches, pp_rank, chunks))",
          "    return max(chunks)",
          ("tests/unit/test_plan.py",), "the dry run holds one microbatch's activations whatever the schedule"),
    Break("hf-head-norms-unsummed", "torchpre/models/hf/parallelize.py",
          "            plan.styles[f\"{path}.{name}\"] = SequenceParallel(sequence_dim=0, use_local_output=True)",
          "            pass",
          (f"{HF_MODELS}::test_per_head_norms_are_summed_over_tensor_parallel_ranks",),
          "Qwen3's per-head norm weights keep each tensor-parallel rank's partial gradient"),
    Break("hf-positions-of-a-sequence-slice", "torchpre/models/hf/model.py",
          "        if self.sequence_shards > 1:\n            kwargs[\"position_ids\"]",
          "        if False:\n            kwargs[\"position_ids\"]",
          (f"{HF_MODELS}::test_layouts_match_one_process",),
          "a transformers model's rotary positions count this rank's slice of the sequence under SP"),
    Break("hf-buffer-init-skipped", "torchpre/models/hf/init.py",
          "    for name, buffer in module.named_buffers():",
          "    for name, buffer in [(n, b) for n, b in module.named_buffers() if not n.endswith(\"embed_scale\")]:",
          ("tests/unit/test_hf_model.py::test_hf_causal_lm_computes_what_transformers_computes",),
          "Gemma's embedding scale (a buffer) keeps what to_empty left in it"),
    Break("cp-causal-mask-of-local-positions", "torchpre/parallel/context_parallel.py",
          "(slice(0, chunk), (rank + 1) * chunk), (slice(chunk, 2 * chunk), (2 * cp - rank) * chunk)",
          "(slice(0, chunk), chunk), (slice(chunk, 2 * chunk), 2 * chunk)",
          (CP_ATTENTION,), "context parallelism masks by local indices, without the shard's global offsets"),
    Break("cp-suffix-prefix-gradient-masked", "torchpre/models/suffix_attention.py",
          "                grad_out, q, k_prefix, v_prefix, out, lse, 0.0, False",
          "                grad_out, q, k_prefix, v_prefix, out, lse, 0.0, True",
          ("tests/unit/test_suffix_attention.py",),
          "the CPU kernel's backward masks the keys before a query chunk as if they were the chunk's own"),
    Break("probe-causal-attention-counted-whole", "torchpre/planner/activation_probe.py",
          "    flops = sdpa_flop_count(query, _query_heads(query, key), _query_heads(query, value))\n"
          "    return round(flops * _causal_share(query, key)) if is_causal else flops",
          "    return sdpa_flop_count(query, _query_heads(query, key), _query_heads(query, value))",
          ("tests/unit/test_activation_probe.py::test_flops_match_the_analytic_count",),
          "the step-time model counts causal attention's masked half, which flash kernels skip"),
    Break("cp-key-gradients-not-summed", "torchpre/parallel/context_parallel.py",
          "            getattr(dist, _REDUCE_SCATTER)(shard, stacked, group=ctx.group)",
          "            shard.copy_(stacked.chunk(size)[dist.get_rank(ctx.group)])",
          (CP_ATTENTION,), "each cp rank keeps only its own queries' share of its keys' and values' gradients"),
    Break("cp-gathers-counted-as-dp", "torchpre/distributed/comm_timer.py",
          "        if (hint := _COUNTED_AS.get()) in kinds:", "        if (hint := None) in kinds:",
          ("tests/distributed/test_parallel_parity.py::test_layout_matches_one_process[cp2]",),
          "context parallelism's key/value gathers count as data parallelism's time where the two share a group"),
    Break("cp-rope-at-local-positions", "torchpre/models/llama3/parallelize.py",
          "    return (x, cp.rope_rows(rope_cache), *rest)", "    return (x, rope_cache, *rest)",
          (CP_MODEL,), "under context parallelism RoPE rotates a shard as if it began at position 0"),
    Break("cp-moe-aux-loss-of-a-shard", "torchpre/models/moe/parallelize.py",
          "            module.sequence_sum = cp.sequence_sum", "            pass",
          ("tests/integration/test_moe.py::test_layout_matches_one_process[cp2xep2]",),
          "under context parallelism each rank's MoE load-balancing loss sees only its part of each sequence"),
    Break("moe-bias-from-local-counts", "torchpre/models/moe/router.py",
          "    dist.all_reduce(load)\n", "",
          ("tests/distributed/test_moe_balancing.py",),
          "each rank moves its MoE routing biases by its own token counts: the biases drift apart across ranks"),
    Break("dsv3-rope-key-gradient-not-summed", "torchpre/models/deepseek_v3/parallelize.py",
          "    shared = DTensor.from_local(rope_key,", "    shared = rope_key  # DTensor.from_local(rope_key,",
          ("tests/distributed/test_deepseek_v3_tensor_parallel.py",),
          "under tp the shared RoPE key's gradient is each rank's heads' share only: wkv_a's replicas diverge"),
    Break("dsv3-yarn-mscale-not-in-softmax-scale", "torchpre/models/deepseek_v3/model.py",
          "        scale *= yarn_mscale(args.yarn.factor, args.yarn.mscale_all_dim) ** 2", "        pass",
          (DEEPSEEK_V3_MLA_TEST,),
          "MLA's softmax scale leaves out YaRN's mscale^2: attention is softer than the released model's"),
    Break("dsv3-latent-cache-rope-key-at-position-0", "torchpre/models/deepseek_v3/model.py",
          "        k_rope = apply_rope(k_rope.unsqueeze(2), rope)",
          "        k_rope = apply_rope(k_rope.unsqueeze(2), rope_cache[:seqlen])",
          (DEEPSEEK_V3_CACHE_TEST,),
          "MLA's latent cache stores each decoded token's RoPE key rotated as if at position 0 (training unchanged)"),
    Break("mtp-loss-not-in-gradient", "torchpre/models/deepseek_v3/model.py",
          "        return self.head(AddAuxLoss.apply(h, mtp_loss))", "        return self.head(h)",
          ("tests/unit/test_multi_token_prediction.py",),
          "multi-token prediction computes and logs its losses but they never reach the gradient"),
    Break("mtp-tokens-ahead-from-local-positions", "torchpre/parallel/context_parallel.py",
          "future_tokens(rows, self.tokens_ahead)[:, self.positions]", "future_tokens(inputs, self.tokens_ahead)",
          (CP_ATTENTION,),
          "under cp each rank reads the tokens ahead from its own (head-tail) positions, not the whole rows"),
    Break("mtp-blocks-not-units", "torchpre/models/deepseek_v3/spec.py",
          "        extra_blocks=mtp_blocks,\n", "",
          ("tests/unit/test_mtp_block_units.py",),
          "multi-token prediction blocks run in the root unit: not checkpointed, compiled or sharded per block"),
    Break("pp-zero-bubble-groups-overlap", "torchpre/parallel/pipeline.py",
          "        return grads, None if param_groups is None else disjoint_param_groups(param_groups)",
          "        return grads, param_groups",
          (ZBV_MTP_TEST,),
          "zero-bubble weight steps run torch's overlapping parameter groups: MTP's embedding copy fails or doubles"),
    Break("pp-zero-bubble-graph-freed-per-group", "torchpre/parallel/pipeline.py",
          "param_groups, retain_graph=True)", "param_groups, retain_graph=False)",
          ("tests/unit/test_zero_bubble_param_groups.py",),
          "zero-bubble weight steps free the graph group by group: a group running through another's nodes fails"),
    Break("fp8-checkpoint-scales-ignored", "torchpre/interchange/reader.py",
          "return (value.float() * blocks).to(torch.bfloat16)", "return value.float().to(torch.bfloat16)",
          ("tests/integration/test_hf_convert.py::test_deepseek_v3_dcp_to_hf_matches_transformers_and_round_trips_bitwise",),
          "a block-FP8 folder (DeepSeek-V3 as released) imports its FP8 values without their block scales"),
    Break("hf-config-unknown-field-ignored", "torchpre/models/hf_fields.py",
          "        if field not in read and field not in fixed and field not in irrelevant:",
          "        if False:",
          (f"{HF_PARITY}::test_a_deepseek_v3_field_torchpre_cannot_honour_is_refused_by_name",
           f"{HF_PARITY}::test_a_llama3_field_torchpre_cannot_honour_is_refused_by_name"),
          "a Hugging Face config.json field torchpre does not know is ignored instead of refused"),
    Break("hf-yarn-attention-factor-ignored", "torchpre/models/deepseek_v3/hf.py",
          '        attention_factor=rope.get("attention_factor"),', "        attention_factor=None,",
          (f"{HF_PARITY}::test_a_deepseek_v3_folder_unlike_any_flavor_gives_transformers_logits[yarn-attention-factor]",),
          "a folder's YaRN attention_factor is dropped: cos and sin keep the scale mscale gives them"),
    Break("hf-rank-reads-whole-tensors", "torchpre/interchange/storage.py",
          "value = self.sources[item.storage_index.fqn].read(self.folder.read, box_of(item))",
          "whole = tuple(slice(0, size) for size in self.shapes[item.storage_index.fqn])\n"
          "                value = self.sources[item.storage_index.fqn].read(self.folder.read, whole)[box_of(item)]",
          (f"{HF_MEMORY}[zero3]",),
          "every rank reads each tensor it holds a shard of whole, and keeps its own box"),
    Break("dsv3-latent-norm-eps", "torchpre/models/deepseek_v3/model.py",
          "self.kv_norm = nn.RMSNorm(args.kv_lora_rank, eps=args.latent_norm_eps)",
          "self.kv_norm = nn.RMSNorm(args.kv_lora_rank, eps=args.norm_eps)",
          (f"{HF_PARITY}::test_a_deepseek_v3_folder_unlike_any_flavor_gives_transformers_logits[rms-norm-eps-1e-5]",),
          "MLA's kv latent norm takes rms_norm_eps, where transformers and DeepSeek fix 1e-6"),
    Break("muon-orthogonalizes-shards", "torchpre/optim/muon.py",
          "self.whole.apply(self._orthogonalize, updates)", "[self._orthogonalize(u) for u in updates]",
          (f"{OPTIMIZER_MATRIX}[Muon-dp2_zero1]",),
          "Muon orthogonalizes each rank's shard of a matrix on its own (what torch.optim.Muon does on shards)"),
    Break("whole-matrices-miss-strided-shards", "torchpre/optim/whole_matrices.py",
          "isinstance(placement, (Shard, _StridedShard))", "isinstance(placement, Shard)",
          ("tests/distributed/test_whole_matrices.py::test_every_layout_is_assembled_and_returned",
           f"{OPTIMIZER_MATRIX}[Muon-dp2_tp2_zero1]"),
          "ZeRO's cut within a TP shard is not gathered: Muon sees half of each column-parallel matrix under dp x tp"),
    Break("pp-document-ids-not-sent-to-stages", "torchpre/parallel/api.py",
          "        run(*args, **targets, **kwargs, return_outputs=False)",
          "        run(*args, **targets, return_outputs=False)",
          ("tests/distributed/test_parallel_parity.py::test_document_mask_layout_matches_one_process[pp2_1f1b_docmask]",),
          "under pipeline parallelism the stages attend across documents: the microbatches' document ids stay behind"),
    Break("docs-flag-misspelt", "docs/multinode.md",
          "    train.py --job.config_file train_configs/debug_model.toml --model.flavor 8B\n",
          "    train.py --job.config_file train_configs/debug_model.toml --model.flavour 8B\n",
          ("tests/unit/test_docs.py::test_every_flag_in_a_shell_block_exists",),
          "a docs block that cannot run here (two 8-GPU machines) passes a flag train.py does not have"),
    Break("fp8-all-gather-as-float8", "torchpre/parallel/data_parallel.py",
          "            output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)",
          "            pass",
          ("tests/distributed/test_float8_all_gather.py",),
          "ZeRO-3's FP8 all-gather sends float8 buffers, which gloo refuses"),
    Break("quantize-conversion-skipped", "torchpre/training/job.py",
          "    convert_linears(model, plan)",
          "    plan",
          ("tests/integration/test_quantize.py::test_low_precision_trains_like_full_precision[float8-rowwise]",),
          "quantize.linear is accepted and logged, but every linear stays in full precision"),
    Break("quantize-experts-skipped", "torchpre/parallel/quantized_experts.py",
          "    layers = set_grouped_mm(model, grouped_mm)",
          "    layers = set_grouped_mm(model, None)",
          ("tests/integration/test_quantize.py::"
           "test_mxfp8_experts_train_like_bf16_and_unlike_experts_left_in_high_precision",),
          "quantize.experts is accepted and logged, but the routed experts stay in high precision"),
    Break("experts-grouped-mm-ignored", "torchpre/models/moe/model.py",
          "self.grouped_mm or _high_precision_grouped_mm", "_high_precision_grouped_mm",
          ("tests/unit/test_quantized_experts.py::test_mxfp8_experts_are_within_mxfp8_error_of_high_precision",),
          "the experts keep a low-precision grouped matmul set from outside but multiply in high precision"),
    Break("experts-scale-blocks-span-experts", "torchpre/parallel/quantized_experts.py",
          "pad_token_groups_for_grouped_mm=True", "pad_token_groups_for_grouped_mm=False",
          ("tests/unit/test_quantized_experts.py::test_an_expert_s_weight_gradient_depends_on_its_own_tokens_only",),
          "MXFP8 weight-gradient scales of 32 tokens span two experts' groups (and fail when a rank's rows are not a "
          "multiple of 32, under expert parallelism)"),
    Break("plan-fp8-rate-ignored", "torchpre/planner/time_model.py",
          "        + work.fp8_flops / (fp8_peak * fp8_efficiency)",
          "        + work.fp8_flops / (hardware.peak_flops * fp8_efficiency)",
          (PUBLISHED_TEST,),
          "the planner runs FP8 matmuls at the bf16 rate: torchtitan's Float8 rows predicted a quarter slow"),
    Break("plan-a100-attention-at-matmul-rate", "torchpre/planner/hardware.py",
          "                 mem_bw=2.0e12, attention_efficiency=A100_FLASH_ATTENTION_EFFICIENCY,",
          "                 mem_bw=2.0e12,",
          (f"{PUBLISHED_TEST}::test_the_a100_attends_at_the_flash_attention_benchmarks_rate_not_its_matmul_rate",),
          "the A100 attends at its matmul rate: MosaicML's A100 rows at 32K-64K tokens predicted up to 82% fast"),
    Break("plan-allocator-gap-dropped", "torchpre/planner/allocator.py",
          "    return round(tensor_bytes * (1 + FRAGMENTATION))", "    return round(tensor_bytes)",
          (PUBLISHED_TEST,),
          "the planner reports the tensor peak as the allocator's: every published memory row 14% low"),
    Break("plan-from-hf-tokenizer-vocabulary", "torchpre/planner/hf_flavor.py",
          "planned.model.vocab_size, planned.model.tokenizer_path = name, vocabulary, str(tokenizer)",
          "planned.model.tokenizer_path = name, str(tokenizer)",
          ("tests/unit/test_plan_hf_flavor.py::test_a_fixed_layout_of_a_released_folder_is_predicted_as_its_flavor",),
          "a released folder is planned with the tokenizer's vocabulary, not its embedding's: Llama 3.1 8B's "
          "128,256-row output layer counted as 2,048 rows"),
    Break("plan-zero3-pipeline-sharded-grads", "torchpre/planner/predict.py",
          "    if checked.pipeline is None or not zero_stage(checked.layout.zero_stage).shards_parameters:",
          "    if True:",
          ("tests/bench/test_plan_vs_measured.py::test_zero3_under_pipelining_is_predicted_with_its_unsharded_gradients",
           "tests/unit/test_published_calibration.py::test_the_rows_nothing_was_fitted_to_are_within_the_bands"),
          "the planner counts ZeRO-3's sharded gradients under pipelining, where FSDP2 holds them unsharded in fp32 "
          "for the step: 21% under the measured dp2 x pp2 run, 19-35% under torchtitan's 405B rows"),
    Break("dry-run-zero3-pipeline-sharded-grads", "torchpre/planner/dryrun.py",
          "        if job.pipeline is not None and job.preflight.data_parallel.shards_parameters:",
          "        if False:",
          ("tests/unit/test_plan.py::test_planner_memory_is_the_dry_runs",),
          "the dry run counts ZeRO-3's sharded gradients under pipelining, where FSDP2 holds them unsharded"),
    Break("plan-cp-never-enumerated", "torchpre/planner/layout_space.py",
          "            for cp in cps if context_parallel else [1]:",
          "            for cp in [1]:",
          ("tests/unit/test_plan.py::test_cp_layouts_are_enumerated_for_every_degree_that_cuts_the_sequence_evenly",),
          "the planner never enumerates a cp degree, so long sequences are never offered context parallelism"),
    Break("plan-cp-only-when-nothing-fits", "torchpre/planner/search.py",
          '    return not any(p.fits and p.checked.layout.activation_checkpoint != "full" for p in predictions)',
          "    return not any(p.fits for p in predictions)",
          ("tests/unit/test_plan.py::test_cp_is_searched_when_only_full_activation_checkpointing_fits",),
          "cp is searched only when nothing fits: a job that fits only by recomputing every block is never offered cp"),
    Break("plan-ep-all-to-all-dropped", "torchpre/planner/stage_costs.py",
          "        if c.group_size == 1:",
          '        if c.group_size == 1 or _collective_kind(c.op) == "all_to_all":',
          ("tests/unit/test_plan.py::test_the_ep_communication_is_the_dispatch_and_combine_of_every_moe_layer",),
          "the planner's step time leaves out expert parallelism's dispatch and combine all-to-alls"),
    Break("plan-expert-grads-reduced-over-dp", "torchpre/planner/predict.py",
          "    dense = state.tp_numel - state.expert_numel", "    dense = state.tp_numel",
          ("tests/unit/test_plan.py::test_expert_gradients_are_reduced_over_the_ranks_that_hold_the_same_experts",),
          "the planner reduces the experts' gradients over all dp ranks instead of the edp ranks that hold them"),
    Break("plan-measured-key-without-ac", "torchpre/planner/cost_cache.py",
          "layout.ep, layout.activation_checkpoint, layout.microbatch_size", "layout.ep, layout.microbatch_size",
          ("tests/unit/test_plan.py::test_a_search_tells_its_measurements_apart_by_their_keys",),
          "a search looks microbatch costs up without their activation checkpointing: every AC mode gets the first "
          "one measured"),
    Break("plan-cp-not-folded-into-dp", "torchpre/planner/stage_costs.py",
          "= p.data_parallel_degree * p.context_parallel_degree, 1", "= p.data_parallel_degree, 1",
          ("tests/unit/test_plan.py::test_cp_layouts_share_the_state_of_dp_x_cp_ranks",),
          "a cp layout's state is measured at dp ranks alone: ZeRO's shards over dp x cp counted cp times too large"),
    Break("plan-zero1-built-at-dp2", "torchpre/planner/stage_costs.py",
          "    if not zero_stage(config.optimizer.zero_stage).shards_optimizer_state and",
          "    if not zero_stage(config.optimizer.zero_stage).shards_parameters and",
          ("tests/unit/test_plan.py::test_cp_layouts_share_the_state_of_dp_x_cp_ranks",),
          "ZeRO-1 and -2 state measured at dp2 whatever the dp: their optimizer state shards counted as halves"),
    Break("plan-transient-interpolated-as-a-number", "torchpre/planner/stage_costs.py",
          "            transient = max((0.0, *trace))", "            trace = ()",
          ("tests/unit/test_plan.py::test_context_parallel_costs_are_interpolated_in_one_over_cp_exactly",
           "tests/unit/test_plan.py::test_microbatch_costs_beyond_two_sequences_are_the_probes"),
          "an interpolated transient is the anchors' peaks interpolated, not the peak of their interpolated live "
          "bytes: short where the peak's moment moves"),
    Break("plan-trace-counts-views", "torchpre/planner/activation_probe.py",
          "            if self._sizes[key] == before:\n                return\n", "",
          ("tests/unit/test_plan.py::test_context_parallel_costs_are_interpolated_in_one_over_cp_exactly",),
          "a probe's trace gets an entry per view of a counted storage: cp2's and cp4's traces differ in length, "
          "and every cp degree is probed instead of interpolated"),
    Break("plan-collective-count-ignored", "torchpre/planner/time_model.py",
          "    return collective.count * group_seconds(collective.op, size, per_node, collective.bytes, hardware)",
          "    return group_seconds(collective.op, size, per_node, collective.bytes, hardware)",
          ("tests/unit/test_plan.py::test_the_cp_communication_is_the_key_and_value_gathers_of_every_attention_layer",),
          "a stage's n blocks run each of a block's collectives once, not n times"),
    Break("plan-shape-keys-regrow-the-probes", "torchpre/planner/stage_costs.py",
          "        setattr(short.model, key, 0)", "        pass",
          ("tests/unit/test_plan_given_layout.py::test_the_shape_keys_shape_the_predicted_model",),
          "model.n_layers re-expands the probes' shortened flavor: Llama 3 8B with its own n_layers predicted at "
          "half the tokens/s and 1.6x the memory"),
    Break("plan-ffn-width-unchecked-for-tp", "torchpre/models/llama3/parallelize.py",
          "    if width % tp:", "    if False:",
          ("tests/unit/test_plan_given_layout.py::test_a_feed_forward_width_tensor_parallelism_cannot_split_is_refused_at_start_up",),
          "a feed-forward width tensor parallelism cannot split evenly passes start-up's checks and ends in a DTensor "
          "traceback"),
    Break("gelu-mlp-computes-silu", "torchpre/models/llama3/model.py",
          "        return self.w2(F.gelu(self.w1(x), approximate=self.approximate))",
          "        return self.w2(F.silu(self.w1(x)))",
          (GELU_REFERENCE,), "model.mlp = 'gelu' trains a SiLU MLP"),
    Break("gelu-tanh-computes-exact-gelu", "torchpre/models/llama3/model.py",
          'approximate="tanh" if args.mlp == "gelu_tanh" else "none")', 'approximate="none")',
          (GELU_REFERENCE,), "model.mlp = 'gelu_tanh' computes the exact GELU, not GPT-2's and Megatron's tanh form"),
    Break("gelu-mlp-swiglu-width", "torchpre/models/llama3/args.py",
          "        hidden = 4 * self.dim if not self.gated_mlp else int(2 * 4 * self.dim / 3)",
          "        hidden = int(2 * 4 * self.dim / 3)",
          (f"{GELU_UNIT}::test_the_gelu_mlp_is_4_x_dim_wide_with_two_matrices",),
          "a GELU MLP takes SwiGLU's 2/3 width: GPT-shaped models (and the corpus's GPT rows) are a third too narrow"),
    Break("gelu-plan-shards-missing-w3", "torchpre/models/llama3/parallelize.py",
          "    if gated:\n        plan[\"feed_forward.w3\"]", "    if True:\n        plan[\"feed_forward.w3\"]",
          (TENSOR_PARALLEL,), "tensor parallelism of a GELU model names SwiGLU's w3 and stops at start-up"),
    Break("gelu-on-moe-accepted", "torchpre/assembly/args.py",
          "    if not args.selectable_mlp:", "    if False:",
          (f"{GELU_UNIT}::test_refused_where_a_gelu_mlp_cannot_apply",),
          "model.mlp = 'gelu' on moe or deepseek_v3 is ignored: their experts stay SwiGLU"),
    Break("gelu-hf-llama-folder-accepted", "torchpre/assembly/args.py",
          "    if isinstance(args, TransformerArgs) and not args.gated_mlp:", "    if False:",
          (f"{GELU_UNIT}::test_refused_with_a_hugging_face_llama_folder",
           f"{GELU_UNIT}::test_conversion_to_a_hugging_face_llama_folder_is_refused"),
          "a GELU model loads, exports or converts to a Hugging Face Llama folder, whose gated MLP it does not have"),
    Break("plan-interleaved-last-stage-held-per-microbatch", "torchpre/planner/predict.py",
          "pipeline.n_microbatches, pp_rank, chunk_bytes)",
          "pipeline.n_microbatches, pp_rank, [max(chunk_bytes)] * len(chunk_bytes))",
          ("tests/unit/test_published_calibration.py::test_the_held_out_errors_are_the_documented_ones",),
          "the planner holds the largest chunk (on an interleaved last rank, the output layer's) for every microbatch "
          "in flight: torchtitan's interleaved 405B row 14% over what it reserved"),
    Break("plan-zero3-pipeline-comm-per-microbatch", "torchpre/planner/time_model.py",
          "    if zero.shards_parameters and layout.pp > 1:", "    if False:",
          ("tests/unit/test_time_model.py::test_zero3_under_pipelining_gathers_and_reduces_once_per_step",),
          "ZeRO-3 under pipelining charged two all-gathers and a reduce-scatter per microbatch (17.45 s of DP "
          "communication per step on Llama 3 405B's layout, against 0.41 s for ZeRO-1)"),
    Break("plan-network-one-nic-per-group", "torchpre/planner/time_model.py",
          "    bw = min(hardware.intra_node_bw, per_node * nic)", "    bw = nic",
          ("tests/unit/test_time_model.py::test_a_group_spanning_nodes_uses_the_nics_of_its_ranks_on_each_node",),
          "a data-parallel group spanning nodes is priced at one NIC's bandwidth: MosaicML's 13B on 64 H100s "
          "predicted 2.07 s of DP communication per step against a measured whole step of 0.853 s"),
    Break("plan-fits-on-tensors", "torchpre/planner/predict.py",
          "        return self.reserved_bytes <= self.hardware.allocator_bytes",
          "        return self.peak.total_bytes <= self.hardware.allocator_bytes",
          ("tests/unit/test_plan_given_layout.py::test_a_layout_fits_when_its_allocator_peak_does",),
          "a layout fits when its tensors do, though a GPU run reserves 1.17 x them: 30 of 140 layouts a search "
          "called fitting predicted more than the card holds"),
    Break("dry-run-fits-on-tensors", "torchpre/planner/dryrun.py",
          "    if reserved <= hardware.allocator_bytes:", "    if worst.total_bytes <= hardware.allocator_bytes:",
          ("tests/unit/test_dryrun.py::test_a_rank_that_does_not_fit_is_named_with_its_largest_part",),
          "the dry run passes a rank whose tensors fit and whose allocator peak does not"),
    Break("plan-shortened-flavor-named-without-its-shape", "torchpre/planner/stage_costs.py",
          '    name = f"{config.model.flavor}[{shape}{n_layers} layers]"',
          '    name = f"{config.model.flavor}[{n_layers} layers]"',
          ("tests/unit/test_plan_given_layout.py::test_the_shape_keys_shape_the_predicted_model",),
          "two shapes of one flavor planned in one process share the first one's cached probes"),
    Break("plan-compiled-memory-without-ac-as-per-op", "torchpre/planner/allocator.py",
          'COMPILED_SAVED_KEPT = {"selective": 0.83, "none": 0.61}',
          'COMPILED_SAVED_KEPT = {"selective": 0.83, "none": 0.83}',
          ("tests/unit/test_compiled_memory.py",),
          "a compiled block without checkpointing is counted as keeping what per-op checkpointing's keeps"),
    Break("published-megatron-flops-misconverted", "bench/published_runs.py",
          "    return tflops * 1e12 / (96 * layers * h**2", "    return tflops * 1e12 / (72 * layers * h**2",
          ("tests/unit/test_published_calibration.py::test_published_throughput_is_converted_as_each_source_counts_it",),
          "Megatron-LM 2021's teraFLOP/s converted to tokens/s without its recomputation's forward"),
    Break("compile-collective-input-unwaited", "torchpre/parallel/compile.py",
          "            block.register_forward_pre_hook(_waited_inputs)",
          "            pass",
          ("tests/integration/test_reshard_matrix.py::test_sampled_reshard[llama_tied-fp32-1proc-to-dp2xtp2-zero3-ac-compile]",),
          "a block compiled per child takes the embedding's unwaited all-reduce (its gradient 2.7% off, TP + compile)"),
    Break("sp-norm-dtensor-into-compiled-attention", "torchpre/models/llama3/parallelize.py",
          '        plan["attention_norm"] = SequenceParallel(use_local_output=True)',
          '        plan["attention_norm"] = SequenceParallel()',
          ("tests/distributed/test_parallel_parity.py::test_layout_matches_one_process[tp2_sp_compile]",),
          "a sequence-parallel norm hands its DTensor to the compiled attention, whose input gradient loses its "
          "reduce-scatter"),
    Break("planner-whole-share-microbatch-dropped", "torchpre/planner/layout_space.py",
          "    return (*MICROBATCH_SIZES, share)",
          "    return MICROBATCH_SIZES",
          ("tests/unit/test_published_calibration.py::test_a_search_for_torchtitans_70b_offers_its_one_microbatch_layout",),
          "the search never tries a rank's whole share of the batch in one microbatch (torchtitan's 70B layout)"),
    Break("published-unstated-knob-slowest-kept", "bench/plan_vs_published.py",
          "    return max(fitting or candidates, key=lambda c: c.tps_per_gpu)",
          "    return min(fitting or candidates, key=lambda c: c.tps_per_gpu)",
          ("tests/unit/test_published_calibration.py::test_a_knob_the_source_does_not_state_is_the_planners_choice",),
          "a row whose source leaves a pipeline knob unstated is predicted at the slowest legal value"),
    Break("published-unstated-schedule-without-1f1b", "bench/published_runs.py",
          '            stages = list(range(1 if "schedule" in self.unstated else 2, n_layers // self.pp + 1))',
          '            stages = list(range(2, n_layers // self.pp + 1))',
          ("tests/unit/test_published_calibration.py::test_a_knob_the_source_does_not_state_is_the_planners_choice",),
          "a row whose source does not state its schedule is never predicted under 1F1B"),
    Break("plan-retimed-prediction-keeps-its-step", "torchpre/planner/predict.py",
          "        step = step_time(self.time_layout, self.works, hardware) if self.works else None",
          "        step = self.step",
          ("tests/unit/test_plan_given_layout.py::test_a_prediction_timed_on_other_hardware_is_that_hardwares_prediction",),
          "a fit times every row on its first profile whatever the candidate efficiencies"),
    Break("dryrun-mxfp8-kernels-on-meta", "torchpre/parallel/quantize.py",
          '        return emulate == "true" or linear == "mxfp8"',
          '        return emulate == "true"',
          ("tests/unit/test_fp8_planning.py::test_an_mxfp8_dry_run_traces_the_emulated_linears",),
          "an MXFP8 dry run calls torchao's triton casts on meta tensors and stops with 'needs triton'"),
    Break("dryrun-cp-attention-with-a-mask", "torchpre/models/suffix_attention.py",
          "        return sdpa(q, k, v, mask=None, is_causal=True)",
          "        mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device)\n"
          "        return sdpa(q, k, v, mask=mask.tril(k.shape[1] - q.shape[1]), is_causal=False)",
          ("tests/unit/test_dryrun.py::test_context_parallel_ranks_hold_their_share_of_the_sequence_and_the_gathered_keys",),
          "the dry run sizes cp attention with a [seq / cp, seq] mask per layer, which the GPU kernels do not keep"),
    Break("gpu-bench-smoke-skips-fp8", "bench/gpu_compare.py",
          "dict.fromkeys((row.model, row.mtp_depth, row.fp8) for row in ROWS)",
          'dict.fromkeys((row.model, row.mtp_depth, "") for row in ROWS)',
          ("tests/bench/test_gpu_bench.py::test_the_smoke_trains_once_per_family_and_precision_of_the_rows",),
          "bench/gpu.sh's smoke mode trains only the bf16 flags: the FP8 rows are never checked before a GPU call"),
    Break("gpu-bench-smoke-skips-deepseek-v3", "bench/gpu_compare.py",
          "dict.fromkeys((row.model, row.mtp_depth, row.fp8) for row in ROWS)",
          'dict.fromkeys((row.model, row.mtp_depth, row.fp8) for row in ROWS if row.model == "llama3")',
          ("tests/bench/test_gpu_bench.py::test_the_smoke_trains_once_per_family_and_precision_of_the_rows",),
          "bench/gpu.sh's smoke mode never trains the DeepSeek-V3 row's flags (MTP, its vocabulary) before a GPU call"),
    Break("gpu-bench-fp8-flags-dropped", "bench/gpu_compare.py",
          "*context_parallel(row), *float8(row),",
          "*context_parallel(row),",
          ("tests/bench/test_gpu_bench.py::test_both_frameworks_get_the_same_run",),
          "the FP8 rows run torchpre in bf16 while torchtitan runs float8"),
    Break("floor-run-without-fp8", "scripts/test_floors.sh",
          '    -e ".[dev,fp8]"',
          '    -e ".[dev]"',
          ("tests/unit/test_floors.py",),
          "the floor run leaves out the fp8 extra: torchao's floor is never installed with torch's"),
    Break("config-bound-not-checked", "torchpre/config/bounds.py",
          "        if not self.admits(value):",
          "        if False:",
          ("tests/unit/test_config_bounds.py",),
          "a key's declared range is never checked: training.steps = 0 or optimizer.lr = -1 reach the job"),
    Break("checkpoint-entry-not-excludable", "torchpre/config/job_config.py",
          '"train", "rng", "health")',
          '"train", "rng")',
          ("tests/unit/test_checkpoint_entries.py",),
          "checkpoint.exclude_from_loading refuses an entry the checkpoint saves (the step guard's health)"),
    Break("weights-resume-ignores-excluded-model", "torchpre/assembly/weights.py",
          '    loads_weights = "model" not in checkpoint.exclude_from_loading',
          "    loads_weights = True",
          ("tests/unit/test_weights_source.py",),
          "a resume that excludes the model skips drawing its weights, leaving them uninitialised"),
    Break("data-stage-values-unchecked-before-work", "torchpre/config/training_schedule.py",
          "    if entry.seq_len < 0:",
          "    if False:",
          ("tests/unit/test_training_schedule_keys.py",),
          "a data stage's negative seq_len reaches the stage table and the loader"),
    Break("fp8-all-gather-without-zero3-accepted", "torchpre/config/validate.py",
          "    if not zero_stage(stage).shards_parameters:",
          "    if False:",
          (f"{BAD_INPUT_CASE}[fp8-all-gather-without-zero3]",),
          "FP8 all-gather is accepted without ZeRO-3, where nothing all-gathers the weights"),
    Break("config-reference-stale", "torchpre/config/job_config.py",
          '"folder for metrics.jsonl, config.toml and checkpoints"',
          '"folder for metrics.jsonl and checkpoints"',
          ("tests/unit/test_docs.py::test_the_configuration_reference_is_current",),
          "an option's help changes and docs/config-reference.md still shows the old text"),
    Break("eval-acc-norm-not-length-normalised", "torchpre/evaluation/multiple_choice.py",
          "        normalised = [score / len(choice) for score, choice in zip(scores, question.choices)]",
          "        normalised = list(scores)",
          ("tests/unit/test_multiple_choice.py",), "acc_norm ranks the choices by their summed log-likelihood, as acc"),
    Break("eval-choice-scored-with-its-context", "torchpre/evaluation/multiple_choice.py",
          "            mask[i, n - row.continuation_length : n] = True",
          "            mask[i, :n] = True",
          ("tests/unit/test_multiple_choice.py",
           f"{HF_EXPORT_EVAL}::test_multiple_choice_scores_equal_transformers_on_the_export"),
          "a choice's log-likelihood includes its context's tokens"),
    Break("hf-export-written-under-its-final-name", "torchpre/checkpoint/published.py",
          '        return self.folder / f"{TMP_PREFIX}step-{step}"',
          "        return self.final(step)",
          ("tests/unit/test_hf_export.py::test_no_step_folder_exists_while_its_files_are_written", PUBLICATION_TEST),
          "an export (or a checkpoint) is written under its final name, which looks complete before it is"),
    Break("export-keeps-the-marker", "torchpre/checkpoint/published.py",
          "            if not self.keeps_marker:", "            if False:",
          ("tests/unit/test_hf_export.py::test_the_export_is_the_familys_mapping_of_the_state_dict_bitwise",),
          "a published Hugging Face export keeps torchpre's marker, a file that is not the model's"),
    Break("convert-output-keeps-the-marker", "torchpre/checkpoint/published.py",
          "    (target / MARKER).unlink()", "    pass",
          ("tests/unit/test_published.py",),
          "convert's output keeps torchpre's marker, a file its manifest or Hugging Face does not know"),
    Break("hf-export-every-rank-writes-every-tensor", "torchpre/interchange/export.py",
          "            if self.owners[name] == self.rank:",
          "            if True:",
          (f"{HF_EXPORT_EVAL}::test_both_ranks_write_a_part_and_neither_the_whole_model",),
          "every rank gathers and writes the whole model"),
    Break("ramp-loss-normalised-by-final-batch", "torchpre/training/job.py",
          "    loss = GlobalMeanLoss(batch, ",
          "    loss = GlobalMeanLoss(CurrentBatch(pre.batches), ",
          (RAMP_TRAINING_TEST,), "a ramped step's loss divides by the final global batch's tokens, not its own"),
    Break("ramp-data-position-by-final-batch", "torchpre/training/job.py",
          "    data = _training_data(config, pre, meshes, device, batch) if",
          "    data = _training_data(config, pre, meshes, device, CurrentBatch(pre.batches)) if",
          (RAMP_TRAINING_TEST,), "the data position advances by the final global batch during a ramp"),
    Break("ramp-pipeline-microbatches-fixed", "torchpre/parallel/pipeline.py",
          "        return sequences // self.microbatch_size if self.microbatch_size else self.n_microbatches",
          "        return self.n_microbatches",
          ("tests/unit/test_pipeline_plan.py::test_a_smaller_step_runs_fewer_microbatches_of_the_set_size",),
          "a ramped pipeline step is cut into the final batch's microbatch count (some empty), not microbatches of the "
          "set size"),
    Break("ramp-rounds-instead-of-truncating", "torchpre/step_rules/ramp.py",
          "        return self.start + int(consumed_samples / per_increment) * self.increment",
          "        return self.start + round(consumed_samples / per_increment) * self.increment",
          (STEP_PLAN_TEST,), "the ramp grows the batch half an increment early (not Megatron's formula)"),
    Break("data-stage-lookup-off-by-one", "torchpre/training/stages.py",
          "        return self.stages[bisect.bisect_right(self._starts, step) - 1]",
          "        return self.stages[bisect.bisect_left(self._starts, step) - 1]",
          (STEP_PLAN_TEST,), "a data stage begins one step after its start step"),
    Break("preemption-usr1-ignored", "torchpre/runtime/preemption.py",
          "STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)",
          "STOP_SIGNALS = (signal.SIGTERM,)",
          ("tests/unit/test_preemption.py",), "Slurm's warning (SIGUSR1) does not stop and save the training"),
    Break("preemption-stop-note-missing", "torchpre/training/trainer.py",
          "            leave_stop_note(step)\n",
          "",
          (STOP_READ_LATE_TEST,), "a training a signal stopped does not tell multinode.slurm, which never requeues"),
    Break("slurm-torchrun-dies-of-the-warning", "multinode.slurm",
          "    trap '' USR1\n",
          "",
          (SLURM_SCRIPT_TEST,), "torchrun is killed by the warning it should leave to its workers"),
    Break("slurm-zero-threads", "multinode.slurm",
          "$(( CPUS >= NPROC_PER_NODE ? CPUS / NPROC_PER_NODE : 1 ))",
          "$(( CPUS / NPROC_PER_NODE ))",
          (SLURM_SCRIPT_TEST,), "fewer CPUs than processes per node gives 0 threads"),
    Break("slurm-loopback-accepted", "multinode.slurm",
          "    if [[ $address == 127.* ]] && (( SLURM_NNODES > 1 )); then",
          "    if false; then",
          (SLURM_SCRIPT_TEST,), "a multi-node job's rendezvous on a loopback address that other nodes cannot reach"),
    Break("slurm-finished-run-requeued", "multinode.slurm",
          "elif [[ -z $STOPPED_AFTER ]]; then",
          "elif false; then",
          (SLURM_SCRIPT_TEST,), "a training that ran to its last step as the warning came is requeued"),
    Break("interpreter-builds-on-a-global", "torchpre/checkpoint/pickled.py",
          "            raise self.refuse(\n                f\"it sets the fields of {_describe(target)}: only an "
          "object this pickle made is given fields, once\"\n            )",
          "            vars(target).update(state)\n            return self.push(target)",
          (PICKLED_TEST,), "a pickled .metadata gives fields to (modifies) a global it names, as BUILD on a class"),
    Break("interpreter-shares-containers", "torchpre/checkpoint/pickled.py",
          "        if not (type(value) in _SCALARS or type(value) in self.grammar.immutable or isinstance(value, "
          "Global)):",
          "        if False:",
          (PICKLED_TEST,), "a pickle uses one list or dict twice: cycles, and work multiplied for whatever walks it"),
    Break("chunks-not-checked-to-tile-the-shape", "torchpre/checkpoint/metadata_checks.py",
          "    return _tiling_problem(size, chunks)", "    return None",
          (f"{METADATA_TEST}::test_metadata_that_means_what_dcp_never_writes_is_refused_by_name",),
          "chunks with a gap load, the gap left as uninitialised memory in the weights"),
    Break("storage-record-past-its-file", "torchpre/checkpoint/metadata_checks.py",
          "        if info.offset + info.length > sizes[name]:", "        if False:",
          (f"{METADATA_TEST}::test_metadata_that_means_what_dcp_never_writes_is_refused_by_name",),
          "a storage record past the end of its file is used"),
    Break("metadata-json-not-preferred", "torchpre/checkpoint/reader.py",
          "    name = METADATA_JSON if listed else METADATA", "    name = METADATA",
          (f"{METADATA_TEST}::test_a_save_lists_metadata_json_in_its_manifest_and_loads_read_it_never_the_pickle",),
          "a torchpre checkpoint's pickled .metadata is read though its metadata.json is there"),
    Break("data-file-opened-through-a-link", "torchpre/checkpoint/reader.py",
          '            with open_file(self.step_dir, name, self.source, "storage_data relative_path") as file:',
          '            with open(self.step_dir / name, "rb") as file:',
          (f"{METADATA_TEST}::test_a_data_file_swapped_for_a_link_after_the_checks_is_never_read",),
          "a checkpoint's data file is read through a symbolic link out of its folder"),
    Break("tensor-bytes-not-checked-as-an-archive", "torchpre/checkpoint/reader.py",
          "        open_archive(window, window.length)", "        window.seek(0)",
          (f"{METADATA_TEST}::test_tensor_bytes_in_a_form_dcp_never_writes_are_refused",),
          "a tensor's bytes in torch's legacy format (or compressed) reach torch.load, which allocates what they say"),
    Break("legacy-entry-decoded-with-torch-load", "torchpre/checkpoint/reader.py",
          "        loaded = torch.load(value, weights_only=False) if self.allow_pickle else self._plain(fqn, "
          "value.getvalue())",
          "        loaded = torch.load(value, weights_only=not self.allow_pickle)",
          (f"{METADATA_TEST}::test_a_legacy_entry_in_legacy_format_is_refused_by_the_load",),
          "a non-tensor entry is decoded by torch.load, which allocates what a legacy-format entry claims"),
    Break("confined-path-allows-dotdot", "torchpre/confined/read.py",
          '    if ".." in PurePosixPath(name).parts:', "    if False:",
          (TRUST_TEST,), "a file name read from a file climbs out of its folder with '..'"),
    Break("confined-open-follows-links", "torchpre/confined/read.py",
          "        return _openat2(dir_fd, name, flags, mode)",
          "        return os.open(name, flags, mode, dir_fd=dir_fd)",
          ("tests/unit/test_confined.py",), "a file of someone else's folder is opened through a symbolic link"),
    Break("confined-fallback-follows-links", "torchpre/confined/read.py",
          "        return os.open(parts[-1], flags | NOFOLLOW | CLOEXEC, mode, dir_fd=current)",
          "        return os.open(parts[-1], flags | CLOEXEC, mode, dir_fd=current)",
          ("tests/unit/test_confined.py",), "without openat2, the last component of a name is opened through a link"),
    Break("json-depth-unbounded", "torchpre/json_input.py",
          "    if depth > MAX_DEPTH:", "    if False:",
          ("tests/unit/test_confined.py",), "JSON from others nests without bound (a RecursionError downstream)"),
    Break("file-read-before-the-manifest-vouches", "torchpre/checkpoint/integrity.py",
          "        if record is not None and not self._whole:", "        if False:",
          (TRUST_TEST,), "a checkpoint file is read without its manifest check"),
    Break("small-file-parsed-without-its-digest", "torchpre/checkpoint/integrity.py",
          "            self._raise_if(_digest_problem(self.step_dir / name, record, zlib.crc32(data), sha))",
          "            pass",
          (f"{BINDING_TEST}::test_a_small_file_is_parsed_only_as_the_bytes_its_digest_vouches_for",),
          "state.json or the metadata altered (same size) and parsed without its CRC or SHA-256 checked"),
    Break("signature-not-checked", "torchpre/checkpoint/integrity.py",
          "    if signing_key is not None:\n        _require_signed(", "    if False:\n        _require_signed(",
          (TRUST_TEST,), "under a signing key, an unsigned or wrongly signed checkpoint loads"),
    Break("state-values-unranged", "torchpre/checkpoint/values.py",
          "        if rule is not None and not rule.holds(value):", "        if False:",
          (BINDING_TEST,), "state.json's values used without their type and range checks (a step of -54)"),
    Break("state-list-length-unchecked", "torchpre/checkpoint/values.py",
          "        if not isinstance(saved, list) or len(saved) != len(live):",
          "        if not isinstance(saved, list):",
          (BINDING_TEST,), "a saved list shorter than the live one (a parameter group's lr left as it was)"),
    Break("signature-does-not-bind-the-step", "torchpre/checkpoint/integrity.py",
          "    elif step is not None and saved_step != step:", "    elif False:",
          (BINDING_TEST,), "a signed step-2 copied as step-4 loads as step 4"),
    Break("signature-does-not-bind-the-run", "torchpre/checkpoint/integrity.py",
          "    elif run is not None and saved_run != run:", "    elif False:",
          (BINDING_TEST,), "another run's signed checkpoint copied into this run's folder is resumed"),
    Break("unlisted-file-read", "torchpre/checkpoint/integrity.py",
          '            self._raise_if(f"{self.step_dir / name} is not in its {MANIFEST}")', "            return None",
          (BINDING_TEST,), "a data file the manifest does not list is read because the metadata names it"),
    Break("unsigned-hf-folder-accepted-under-a-key", "torchpre/interchange/load.py",
          "        if not allow_unsigned:", "        if False:",
          ("tests/integration/test_hf_signing.py::test_a_hugging_face_folder_loads_under_a_key_only_as_signed"
           "[unsigned-initial_load_path]",),
          "with a signing key set, an unsigned Hugging Face folder loads as a run's weights"),
    Break("component-refusal-left-as-a-traceback", "torchpre/checkpoint/manager.py",
          "            load_component(self.components[key], key, state, step_dir)",
          "            self.components[key].load_state_dict(state)",
          (f"{BINDING_TEST}::test_values_a_component_refuses_together_are_bad_input_naming_the_checkpoint",),
          "values a component refuses together (a data position off the batch grid) end a resume in a traceback"),
    Break("hub-blob-link-of-any-form-followed", "torchpre/confined/read.py",
          '    if match is None or match.group(1).count("../") != len(PurePosixPath(name).parts) + 1:',
          "    if False:",
          ("tests/unit/test_foreign_inputs.py::test_a_hub_cache_snapshot_reads_its_blobs_and_no_other_link",),
          "a link inside a Hugging Face folder is followed as a hub cache blob whatever its form"),
    Break("confined-append-follows-links", "torchpre/confined/write.py",
          "        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | NOFOLLOW | NONBLOCK | CLOEXEC, 0o644)",
          "        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | NONBLOCK | CLOEXEC, 0o644)",
          ("tests/unit/test_confined.py::test_an_append_or_a_marker_through_a_link_is_refused",),
          "metrics.jsonl is appended to through a symbolic link, writing wherever it leads"),
    Break("confined-folder-through-a-link", "torchpre/confined/write.py",
          "            if not stat.S_ISDIR(os.lstat(current).st_mode):", "            if False:",
          ("tests/unit/test_run_folder_writes.py::test_a_folder_torchpre_writes_into_is_refused_when_it_is_a_link",),
          "a folder torchpre writes into inside the run folder is a link to another folder, and is written through"),
    Break("clean-up-without-the-marker", "torchpre/checkpoint/folders.py",
          "    elif not is_regular_file(path / MARKER):", "    elif False:",
          (TRUST_TEST,), "the clean-up of unfinished saves deletes a `.tmp-` folder torchpre did not make"),
    Break("failed-write-removes-an-unmarked-tmp", "torchpre/checkpoint/published.py",
          "        remove_if_ours(tmp, names)", "        __import__('shutil').rmtree(tmp)",
          ("tests/unit/test_published.py",
           "tests/unit/test_hf_export.py::test_a_failed_export_leaves_a_tmp_folder_that_lost_torchpres_marker",
           "tests/unit/test_checkpoint_publication.py::test_a_failed_save_leaves_a_tmp_folder_that_lost_torchpres_marker"),
          "a failed save, export or convert removes its `.tmp-` folder though it no longer holds torchpre's marker"),
    Break("metrics-jsonl-appended-through-a-link", "torchpre/metrics/sinks.py",
          'self._file = io.TextIOWrapper(open_for_append(folder / "metrics.jsonl"), encoding="utf-8")',
          'self._file = (folder / "metrics.jsonl").open("a", encoding="utf-8")',
          (f"{RUN_FOLDER_WRITES}::test_metrics_jsonl_is_never_appended_or_read_through_a_link",),
          "metrics.jsonl appended through a symbolic link: a run writes wherever the folder's author points it"),
    Break("marker-touched-through-a-link", "torchpre/checkpoint/folders.py",
          "    touch_marker(folder / MARKER)", "    (folder / MARKER).touch()",
          (f"{RUN_FOLDER_WRITES}::test_a_marker_is_never_touched_through_a_link_and_retention_keeps_that_step",),
          "a checkpoint's marker touched through a symbolic link: retention creates or touches a file outside"),
    Break("export-clean-up-without-the-marker", "torchpre/interchange/export.py",
          "            self.steps.remove_unfinished()",
          "            [__import__('shutil').rmtree(p, ignore_errors=True) for p in self.folder.glob('.tmp-*')]",
          ("tests/unit/test_hf_export.py::test_the_clean_up_removes_only_marked_unfinished_exports_and_follows_no_link",),
          "the export clean-up removes every `.tmp-` folder in hf_export.folder, torchpre's marker or not"),
    Break("resume-parses-the-checkpoints-config-toml", "torchpre/training/stages.py",
          "    if record is None:\n        return None\n",
          "    from torchpre.config.parser import parse_args\n\n"
          "    config_toml = str(step_dir / \"config.toml\")\n"
          "    return StageTable.from_config(parse_args(JobConfig, [\"--job.config_file\", config_toml]))\n",
          ("tests/integration/test_stages_on_resume.py",),
          "a resume parses the checkpoint's config.toml for the stages it compares, which torchpre never reads back"),
    Break("publish-deletes-the-existing-step", "torchpre/checkpoint/folders.py",
          "    replaced = move_aside(final, REPLACED) if final.exists() or final.is_symlink() else None",
          "    replaced = remove_step(final) if final.exists() else None",
          (TRUST_TEST,), "publishing step N deletes an existing step-N without a word"),
    Break("damaged-checkpoint-left-in-place", "torchpre/checkpoint/folders.py",
          "            target = move_aside(folder / f\"step-{step}\", DAMAGED)",
          "            target = folder / f\"step-{step}\"",
          (f"{CHECKPOINT}::test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one",),
          "a damaged checkpoint a resume skipped stays a step-N, for retention to count and a save to replace"),
    Break("token-ids-beyond-the-vocabulary-unchecked", "torchpre/data/shard_dataset.py",
          "        if int(window.max()) >= self.reader.vocab_size:", "        if False:",
          (f"{BAD_INPUT}::test_bad_input_fails_fast_with_one_message[shards-token-id-beyond-the-vocabulary-unrecorded]",),
          "a shard token id beyond the vocabulary reaches the embedding (an IndexError mid-run)"),
    Break("shard-token-ids-against-the-manifest-vocab", "torchpre/data/shards.py",
          "        self.vocab_size = vocab_size", "        self.vocab_size = self.manifest.vocab_size",
          (f"{FOREIGN}::test_a_manifest_claiming_more_ids_than_the_embedding_has_rows_is_refused",
           f"{BAD_INPUT_CASE}[shards-manifest-claims-a-larger-vocabulary]"),
          "shard token ids are checked against the manifest's vocab_size, not the model's embedding rows: a manifest "
          "claiming more ids ends in an IndexError mid-run"),
    Break("shard-file-opened-without-the-confined-open", "torchpre/data/shards.py",
          "        file = open_file(folder, name, folder / MANIFEST, entry)", '        file = open(path, "rb")',
          (f"{BAD_INPUT_CASE}[shards-link-part-0.bin]", f"{BAD_INPUT_CASE}[shards-link-subfolder]"),
          "a shard file is opened by its path, through a symbolic link out of the folder"),
    Break("shard-descriptors-unbounded", "torchpre/data/shards.py",
          "        if len(self._open) > MAX_OPEN_SHARDS:", "        if False:",
          (MANY_SHARDS_TEST,), "every shard read keeps its descriptor open: a folder of 100,000 shards runs out"),
    Break("shard-folder-resolved-per-file", "torchpre/data/shards.py",
          "        self._root = OpenFolder(self.folder)", "        self._root = self.folder",
          (MANY_SHARDS_TEST,), "the folder is looked up again for every shard file opened"),
    Break("shard-offsets-opened-for-training", "torchpre/data/shards.py",
          "            file = open_tokens(self._root, self.manifest, shard)",
          "            check_shard_files(self._root, self.manifest, shard)\n"
          "            file = open_tokens(self._root, self.manifest, shard)",
          (MANY_SHARDS_TEST,), "training opens each shard's .idx too, which windows never need"),
    Break("prepare-manifest-rewritten-per-shard", "torchpre/data/prepare.py",
          "        self.manifest.shards.append(shard)",
          "        self.manifest.shards.append(shard)\n        self.manifest.write(self.folder)",
          ("tests/unit/test_prepare.py::test_the_manifest_is_written_twice_whatever_the_shard_count",),
          "prepare rewrites the whole manifest after every shard: quadratic in the shard count"),
    Break("prepare-journal-not-read", "torchpre/data/shards.py",
          "        if not manifest.complete:\n            manifest.shards += _journal(folder, len(manifest.shards))",
          "        if False:\n            manifest.shards += _journal(folder, len(manifest.shards))",
          ("tests/unit/test_prepare.py::test_resume_after_an_interruption_writes_only_the_missing_shards",),
          "a resumed prepare forgets the shards its journal lists and writes them all again"),
    Break("feistel-cycle-walk-dropped", "torchpre/data/sampler.py",
          "        while index >= self.num_samples:", "        while False:",
          (FEISTEL_TEST,), "the Feistel order hands out indices past the last sample (no cycle walking)"),
    Break("feistel-keys-the-same-every-epoch", "torchpre/data/sampler.py",
          "            entropy = [self.seed % 2**64, _ORDER_STREAM, epoch]",
          "            entropy = [self.seed % 2**64, _ORDER_STREAM, 0]",
          (FEISTEL_TEST,), "every epoch repeats the first one's order"),
    Break("order-version-of-an-old-checkpoint-taken-as-new", "torchpre/data/loader.py",
          '        version = int(state_dict.get("order_version", 1))',
          '        version = int(state_dict.get("order_version", ORDER_VERSION))',
          (OLD_ORDER_TEST,),
          "a checkpoint saved before order versions resumes in the new order, not the one it trained in"),
    Break("order-version-not-restored", "torchpre/data/loader.py",
          "            self.order_version, self.loader = version, self.loader_for(self.stage, version)",
          "            pass",
          (OLD_ORDER_TEST,), "a resume keeps the new order whatever order its checkpoint was trained in"),
    Break("mixture-block-rebuilt-per-position", "torchpre/data/mixture.py",
          "        if self._block.start <= position < self._block.end:", "        if False:",
          ("tests/unit/test_shard_data.py::"
           "test_positions_read_in_order_build_each_mixture_block_once_whatever_the_number_of_sources",),
          "every mixture position rebuilds its block: a pass over all the sources per sample"),
    Break("prepare-task-reads-every-file", "torchpre/data/prepare.py",
          "        if index <= (before + size / 2) * count / total < index + 1 or",
          "        if True or",
          (SPLIT_PREPARE_TEST,), "every task of a split prepare tokenizes every input: the merge holds each N times"),
    Break("prepare-merge-out-of-task-order", "torchpre/data/prepare.py",
          "    parts = [_finished_part(folder, index, count, tokenizer) for index in range(count)]",
          "    parts = [_finished_part(folder, index, count, tokenizer) for index in reversed(range(count))]",
          (SPLIT_PREPARE_TEST,), "the merge concatenates the tasks' parts in another order than the inputs'"),
    Break("shard-batch-not-read-ahead", "torchpre/data/shard_dataset.py",
          "                self._will_need(index * (self.seq_len + 1), self.seq_len + 1)", "                pass",
          ("tests/unit/test_shard_data.py::test_the_loader_asks_the_kernel_for_a_whole_batch_of_windows_before_reading_them",),
          "a batch's windows are read one by one, each waiting for the disk in turn"),
    Break("hf-safetensors-opened-by-path", "torchpre/interchange/reader.py",
          'return cls(file, safe_open(_descriptor_name(file), framework="pt"))',
          'return cls(file, safe_open(path, framework="pt"))',
          (f"{FOREIGN}::test_safetensors_are_read_from_the_checked_descriptor_not_the_name",),
          "safetensors opens a folder's file by its name, following a link put there after the check"),
    Break("hf-file-opened-without-the-confined-open", "torchpre/interchange/reader.py",
          '            file = open_file(*located(folder, name), index, f"weight_map (file {name!r})" if index else "")',
          '            file = open(path, "rb")',
          (f"{BAD_INPUT_CASE}[hf-link-model.safetensors-from-hf]",
           f"{BAD_INPUT_CASE}[hf-link-model-00002-of-00003.safetensors-hf-to-dcp]"),
          "a Hugging Face folder's safetensors file is opened through a symbolic link out of the folder"),
    Break("hf-config-field-kinds-unchecked", "torchpre/models/hf_fields.py",
          "        if field in config and not kind.accepts(config[field]):", "        if False:",
          (f"{FOREIGN}::test_every_config_field_of_the_wrong_kind_is_refused_by_name",),
          'config.json field types unchecked: a size of 0 or "256" reaches arithmetic and constructors'),
    Break("loss-chunk-gradient-dropped", "torchpre/parallel/linear_cross_entropy.py",
          "            grad_logits.mul_(scale[rows, None])",
          "            grad_logits.mul_(scale[rows, None] * (rows.stop < len(labels)))",
          (f"{LINEAR_CROSS_ENTROPY}::test_chunked_loss_and_every_gradient_equal_the_full_logits[llama3-7-short-last]",),
          "the chunked loss's backward drops its last chunk's share of the hidden states' and weight's gradients"),
    Break("loss-chunk-max-not-reduced-over-tp", "torchpre/parallel/linear_cross_entropy.py",
          "        dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=shard.group)", "        pass",
          (TENSOR_PARALLEL,), "each tensor-parallel rank offsets its chunk's exponentials by its own shard's maximum"),
    Break("mup-factors-from-local-shapes", "torchpre/optim/distributed_optimizer.py",
          "keys = {p.name: scales.key(p.name, p.param.shape) for p in self.params}",
          "keys = {p.name: scales.key(p.name, p.local.shape) for p in self.params}",
          (f"{PARITY}::test_model_variant_layout_matches_one_process[mup_tp2_sp_lp]",),
          "µP's per-parameter learning rates computed from a rank's shard: a row-parallel matrix's halved fan-in"),
    Break("mup-attention-scale-left-at-sqrt-d", "torchpre/models/parametrization.py",
          "attention_multiplier=(base_head_dim / head_dim) ** 0.5,", "attention_multiplier=1.0,",
          (f"{MUP_UNIT}::test_attention_scale_is_one_over_head_dim_and_logits_shrink_with_width",),
          "µP's attention scale left at 1/sqrt(head dim) instead of sqrt(base head dim) / head dim"),
    Break("mup-logits-at-the-standard-scale", "torchpre/models/parametrization.py",
          "logit_multiplier=settings.logit_multiplier / width,", "logit_multiplier=settings.logit_multiplier,",
          (f"{MUP_INTEGRATION}::test_coordinate_check_holds_under_mup_and_fails_under_the_standard_logit_scaling",),
          "µP's logit multiplier left at the base's instead of base / width: the logits' updates grow with width"),
    Break("mup-export-not-folded", "torchpre/models/llama3/hf.py",
          "state_dict = fold_multipliers(state_dict, args.parametrization, _MULTIPLIED, args.tie_word_embeddings)",
          "state_dict = dict(state_dict)",
          (f"{MUP_INTEGRATION}::test_hf_export_of_a_mup_model_gives_transformers_torchpres_logits[llama3-untied]",),
          "a µP model exported to Llama without its multipliers: transformers computes another model"),
    Break("mup-mtp-logits-without-the-multiplier", "torchpre/models/deepseek_v3/mtp.py",
          "                normed = normed * self.logit_multiplier", "                pass",
          ("tests/unit/test_multi_token_prediction.py::test_gradients_equal_the_written_out_loss_and_depth_losses_are_logged[logit-multiplier]",),
          "the multi-token prediction depths' logits left without the parametrization's logit multiplier"),
    # Hugging Face tokenizers (issue 62).
    Break("tokenizer-bos-not-added", HF_TOKENIZER,
          "    return Framing(prefix[0] if prefix else None, eos_id)", "    return Framing(None, eos_id)",
          (f"{HF_TOKENIZER_IDS_TEST}[byte_fallback]", f"{PREPARE_HF_TEST}[byte_fallback]"),
          "documents framed without the BOS that tokenizer_config.json and the post-processor say the family adds"),
    Break("tokenizer-config-add-bos-ignored", HF_TOKENIZER,
          '    _agree(files, "add_bos_token", add_bos, prefix, "before")', "",
          (f"{HF_TOKENIZER_TEST}::test_a_config_that_disagrees_with_the_post_processor_is_refused_naming_both",),
          "a tokenizer_config.json whose add_bos_token contradicts tokenizer.json's post-processor accepted"),
    Break("tokenizer-special-token-text-special", HF_TOKENIZER,
          "        self._library.encode_special_tokens = True\n", "",
          (f"{HF_TOKENIZER_TEST}::test_special_token_text_in_a_document_is_ordinary_text",),
          "special-token text inside a document (\"<|endoftext|>\") encoded as the special token, ending it"),
    Break("tokenizer-truncation-kept", HF_TOKENIZER,
          "        self._library.no_truncation()  # a document is tokenized whole\n", "",
          (f"{HF_TOKENIZER_TEST}::test_truncation_and_padding_in_tokenizer_json_leave_a_document_whole",),
          "a document cut at the truncation length a released tokenizer.json carries"),
    Break("shards-tokenizer-hash-unchecked", "torchpre/data/shards.py",
          "        if expected_tokenizer_sha256 and self.manifest.tokenizer_sha256 != expected_tokenizer_sha256:",
          "        if False:",
          ("tests/unit/test_prepare.py::test_shard_reader_refuses_another_tokenizer_hash",
           f"{PREPARE_HF_TEST}[byte_level]"),
          "shards made with another tokenizer trained on (the manifest's tokenizer hash not checked)"),
    Break("tokenizer-folder-default-ignored", "torchpre/assembly/tokenizer.py",
          "    if config.checkpoint.initial_load_path and is_hf_folder(folder):",
          "    if False:",
          (f"{RELEASED_TOKENIZER}::test_shards_hold_the_released_tokenizers_ids_and_train_under_its_default",),
          "a released folder's own tokenizer.json not the default tokenizer of a job that starts from it"),
    Break("released-vocabulary-below-the-tokenizer-accepted", "torchpre/assembly/args.py",
          "    if tokenizer.vocab_size > rows:", "    if False:",
          (f"{BAD_INPUT_CASE}[hf-folder-vocab-below-the-tokenizer]",),
          "a released folder whose embedding has fewer rows than the tokenizer has ids trains, indexing past it"),
    Break("mup-with-an-optimizer-without-a-rule-accepted", "torchpre/assembly/args.py",
          "    if get_optimizer(name).mup_update is None:", "    if False:",
          (f"{BAD_INPUT_CASE}[mup-with-muon]",),
          "model.parametrization = 'mup' with Muon trains with factors no rule states"),
    Break("model-args-without-the-protocol-registered", "torchpre/models/registry.py",
          "        if not isinstance(args, ModelArgs):", "        if False:",
          ("tests/unit/test_model_registry.py::test_a_flavor_whose_args_lack_the_model_args_protocol_is_refused",),
          "a family whose args lack ModelArgs' members registers, and fails later with an AttributeError deep in"),
    Break("tokenizer-files-not-exported", "torchpre/interchange/folder.py",
          "    for name, data in tokenizer.hf_files(max_length).items():",
          "    for name, data in {}.items():",
          (f"{RELEASED_TOKENIZER}::test_the_export_holds_the_tokenizer_and_the_model_transformers_load_as_torchpre_has_them",),
          "an export without the tokenizer files AutoTokenizer loads"),
    Break("eval-empty-context-without-a-prefix-token", "torchpre/evaluation/multiple_choice.py",
          "    return context_ids or [tokenizer.eos_id], whole[len(context_ids) :]",
          "    return context_ids, whole[len(context_ids) :]",
          ("tests/unit/test_multiple_choice.py::"
           "test_a_pair_of_a_hugging_face_tokenizer_is_transformers_ids_split_as_lm_evaluation_harness_splits",),
          "an empty context of a tokenizer without BOS left empty, not lm-evaluation-harness's prefix token EOS"),
    Break("document-mask-without-bos-accepted", "torchpre/training/preflight.py",
          "    if config.training.document_mask and tokenizer.bos_id is None:", "    if False:",
          (f"{BAD_INPUT_CASE}[tokenizer-json-without-bos-under-the-document-mask]",),
          "training.document_mask accepted with a tokenizer that starts documents with no BOS to find them by"),
    Break("deepseek-v3-tied-output-from-lm-head", "torchpre/models/deepseek_v3/hf.py",
          "        if fqn == _MTP_EMBEDDING or (fqn == _TIED and args.tie_word_embeddings):",
          "        if fqn == _MTP_EMBEDDING:",
          (f"{HF_PARITY}::test_a_deepseek_v3_folder_unlike_any_flavor_gives_transformers_logits[tied]",),
          "a tied DeepSeek-V3 folder's output layer read from an lm_head.weight transformers never saves"),
    Break("deepseek-v3-tied-lm-head-unchecked", "torchpre/models/deepseek_v3/hf.py",
          "        copies[\"tok_embeddings.weight\"] += (Copy(_TOP_LEVEL[_TIED], why),)",
          "        pass",
          (HF_IMPORT_TIED,),
          "a tied DeepSeek-V3 config beside an lm_head.weight that differs from the embedding loaded"),
    Break("hf-config-fields-not-compared", "torchpre/models/hf/convert.py",
          "IRRELEVANT}, relevant)[:6]", "IRRELEVANT}, relevant)[:0]",
          (f"{BAD_INPUT_CASE}[hf-config-of-another-model-than-the-folders]",),
          "model.hf_config with another rope_theta and rms_norm_eps than the folder's config.json accepted"),
    Break("snapshot-published-before-complete", "torchpre/checkpoint/snapshots/manager.py",
          '        temporary, final = self.folder / f".tmp-{name}", self.folder / name',
          "        temporary = final = self.folder / name",
          (f"{SNAPSHOTS_TEST}::test_a_full_folder_turns_snapshots_off_everywhere_without_publishing_that_step",),
          "an in-memory snapshot written under its final name, visible before its bytes are"),
    Break("snapshot-ranks-resume-different-steps", "torchpre/checkpoint/snapshots/restore.py",
          "if all((rank, step) in holders for rank in range(len(listings)))",
          "if any((rank, step) in holders for rank in range(len(listings)))",
          (f"{SNAPSHOT_FILE_TEST}::test_the_step_chosen_is_the_newest_complete_for_every_rank",
           f"{SNAPSHOTS_TEST}::test_restarts_agree_on_one_step_use_replicas_and_never_a_torn_file"),
          "a restart resumes a snapshot step that is not complete on every rank (ranks on different steps)"),
    Break("loader-draws-from-the-global-generator", "torchpre/data/loader.py",
          "pin_memory=pin_memory, generator=torch.Generator()",
          "pin_memory=pin_memory",
          ("tests/integration/test_snapshots.py::test_a_killed_node_resumes_from_the_snapshots_of_the_step_before_bitwise",),
          "a resume's first iterator moves the global generator a checkpoint saved: the RNG states end unlike the "
          "uninterrupted run's"),
    Break("heap-abort-rerun-in-a-used-folder", "tests/launch.py",
          "            restore()\n",
          "",
          ("tests/unit/test_launch_heap_abort.py",),
          "the test launcher reruns an aborted job in the folder the aborted run left, not the one it started from"),
    Break("linked-step-in-a-fresh-run-skipped", "torchpre/assembly/weights.py",
          "        find_intact_step(folder, checkpoint.load_step, trust)",
          "        pass",
          ("tests/unit/test_weights_source.py::test_a_folder_of_step_links_only_is_refused_by_name_never_a_fresh_run",
           "tests/integration/test_run_folder_links.py::test_no_write_of_a_run_goes_through_a_link_in_its_folder"),
          "a run whose checkpoint folder holds only step-N links starts from the seed instead of naming them"),
    Break("any-annotation-back", "torchpre/json_input.py",
          "def nesting_depth(value: JsonValue) -> int:",
          "def nesting_depth(value: Any) -> int:",
          ("tests/unit/test_typed_boundaries.py::test_any_annotations_in_torchpre_stay_within_the_pin",),
          "a value annotated Any again (the type checker turned off for it) passes unnoticed"),
    Break("resume-searches-past-the-chosen-step", "torchpre/checkpoint/manager.py",
          "        if latest:\n            return self.find(-1) or chosen",
          "        if True:\n            return self.find(-1) or chosen",
          ("tests/unit/test_checkpoint_integrity.py::"
           "test_a_resume_loads_preflight_s_step_and_looks_again_only_past_a_damaged_latest",),
          "a resume searches the folder again instead of loading the step preflight found, skipping a damaged chosen "
          "step for another one"),
    Break("ac-selective-option-unchecked-before-work", "torchpre/config/validate.py",
          '    if ac.mode == "selective" and option != "op" and (not option.isdigit() or int(option) < 1):',
          "    if False:",
          ("tests/unit/test_activation_checkpoint.py::"
           "test_a_selective_option_that_is_neither_op_nor_a_positive_count_stops_in_validation",),
          "a selective_ac_option that is no block count passes start-up and fails when the blocks are wrapped"),
    Break("resolve-step-mark-dropped", "torchpre/training/batches.py",
          "@resolve_step\ndef batch_sizes(", "def batch_sizes(",
          ("tests/unit/test_config_error_homes.py::test_config_errors_outside_the_resolve_steps_do_not_grow",),
          "the counter of ConfigErrors outside the resolve steps misses a step's raises moving out of it"),
    Break("resolve-step-skipped-by-preflight", "torchpre/training/preflight.py",
          "    window = evaluation_window(config, tokenizer)\n",
          "    window = config.eval.max_length or config.training.seq_len\n",
          ("tests/unit/test_config_error_homes.py::test_preflight_runs_every_resolve_step",),
          "a marked resolve step that preflight no longer runs (eval.max_length unchecked) passes as a step"),
    # The embedding and the output counted as layers of an even pipeline split (parallelism.pipeline_parallel_
    # embedding_layers / _output_layers).
    Break("pp-embedding-layers-not-counted", "torchpre/parallel/pipeline.py",
          "    sizes[0] -= embedding_layers\n", "",
          ("tests/unit/test_pipeline_plan.py::test_embedding_and_output_count_as_layers_of_an_even_split",),
          "the first stage holds as many blocks as the others beside the embedding"),
    Break("pp-empty-middle-stage-accepted", "torchpre/parallel/pipeline.py",
          "    if min(sizes) < (0 if counted else 1) or min(sizes[1:-1], default=1) < 1:",
          "    if min(sizes) < (0 if counted else 1):",
          ("tests/unit/test_pipeline_plan.py::test_embedding_and_output_layer_refusals",),
          "a split leaving a middle stage without a block starts (torch then runs a stage that does nothing)"),
    Break("pp-split-counts-not-read-at-start-up", "torchpre/training/preflight.py",
          '            "embedding_layers": p.pipeline_parallel_embedding_layers,\n',
          '            "embedding_layers": 0,\n',
          ("tests/unit/test_plan.py::test_the_planner_prices_meta_s_405b_split_with_the_embedding_and_the_output_alone",),
          "start-up (and the planner's --fixed) ignores parallelism.pipeline_parallel_embedding_layers"),
    Break("pp-split-counts-reach-the-probes", "torchpre/planner/stage_costs.py",
          "    short.parallelism.pipeline_parallel_embedding_layers = "
          "short.parallelism.pipeline_parallel_output_layers = 0\n",
          "",
          ("tests/unit/test_plan.py::"
           "test_the_planner_prices_stages_holding_the_embedding_or_the_output_alone_as_the_dry_run",),
          "the planner's two-stage probes inherit the job's counts with their own split points: refused"),
]

def breaks_table(breaks: list[Break]) -> str:
    """The breaks as a Markdown table: what each breaks, where, and the tests that must catch it."""
    rows = [f"| `{b.name}` | {b.breaks} | `{b.file}` | {', '.join(f'`{t}`' for t in b.tests)} |" for b in breaks]
    return "\n".join(["| break | what it breaks | file | caught by |", "|---|---|---|---|", *rows])


def check_unique(repo: Path, breaks: list[Break]) -> None:
    """Every break's old text occurs exactly once in its file; stops naming the first that does not."""
    for b in breaks:
        count = (repo / b.file).read_text().count(b.old)
        if count != 1:
            sys.exit(f"mutation '{b.name}': its old text occurs {count} times in {b.file}, not once: {b.old!r}")


def run_tests(repo: Path, tests: tuple[str, ...], timeout: float) -> tuple[bool, str]:
    """(passed, why not: pytest's first failure line or the timeout) for `tests` run against the copy `repo`."""
    env = {**os.environ, "PYTHONPATH": str(repo), "PYTHONDONTWRITEBYTECODE": "1"}
    pytest = [sys.executable, "-m", "pytest", "-q", "-x", "-rf", "-p", "no:cacheprovider", "-m", "not mutation"]
    try:
        result = subprocess.run([*pytest, *tests], cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:.0f} s"
    lines = result.stdout.splitlines()
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    # A spawned worker's exception is quoted in pytest's "E " lines, not in the FAILED summary.
    errors = [line[1:].strip() for line in lines if line.startswith("E ") and "Error" in line and "Raised" not in line]
    why = " | ".join(failed[:1] + errors[:1])
    return result.returncode == 0, why or result.stdout[-1500:] + result.stderr[-1500:]


def copy_repo(repo: Path, target: Path) -> Path:
    shutil.copytree(repo, target, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", ".venv"))
    return target


def run_break(b: Break, repo: Path, workdir: Path, timeout: float) -> tuple[bool, float, str]:
    """(caught, seconds, why) for one break applied to a fresh copy of the repository; a hang counts as caught."""
    copy = copy_repo(repo, workdir / b.name)
    path = copy / b.file
    path.write_text(path.read_text().replace(b.old, b.new))
    start = time.monotonic()
    passed, why = run_tests(copy, b.tests, timeout)
    shutil.rmtree(copy, ignore_errors=True)
    return not passed, time.monotonic() - start, why


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="only the breaks whose name contains this")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per break before it counts as a hang")
    parser.add_argument("--list", action="store_true", help="print the breaks as a Markdown table and run none")
    args = parser.parse_args(argv)
    breaks = [b for b in BREAKS if args.k in b.name]
    if args.list:
        print(breaks_table(breaks))
        return 0
    check_unique(REPO, breaks)
    survived, start = [], time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mutation-") as workdir:
        # Unbroken first: a break only counts as caught if its tests pass without it.
        subsets = tuple(dict.fromkeys(test for b in breaks for test in b.tests))
        passed, why = run_tests(copy_repo(REPO, Path(workdir) / "unbroken"), subsets, args.timeout)
        print(f"unbroken: {len(subsets)} test subsets {'pass' if passed else 'FAIL'} "
              f"({time.monotonic() - start:.0f} s)", flush=True)
        if not passed:
            print(why)
            return 2
        for b in breaks:
            caught, seconds, why = run_break(b, REPO, Path(workdir), args.timeout)
            print(f"{'caught  ' if caught else 'SURVIVED'} {seconds:6.1f} s  {b.name}: {b.breaks}", flush=True)
            print(f"    {why[:300]}" if caught else why, flush=True)
            if not caught:
                survived.append(b.name)
    print(f"{len(breaks) - len(survived)} of {len(breaks)} breaks caught in {time.monotonic() - start:.0f} s"
          + (f"; survived: {', '.join(survived)}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
