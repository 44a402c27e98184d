"""A ``pretrain_gpt.py`` of powerlib's own: Megatron-LM's real ``pretrain()``, a tiny GPT, on CPU.

test_megatron_pretrain.py (the Python 3.12 lane: ``megatron.training`` ships with megatron-core
0.17+) launches it on two gloo ranks (PP=2), from another working directory, the way Megatron-LM
users launch theirs::

    POWERLIB_MEGATRON=1 torchrun ... -m powerlib.integrations.megatron megatron_pretrain_gpt.py ARGS

It calls ``pretrain(...)`` as Megatron-LM 0.19's ``pretrain_gpt.py`` does: arguments parsed and
validated by Megatron (``parse_and_validate_args``), the model config and the config container
built from them (``gpt_config_from_args``, ``pretrain_cfg_container_from_args``), a
train/valid/test datasets provider on ``MockGPTDataset`` (``--mock-data``), and a
``forward_step`` whose loss function masks and sums the per-token losses. Everything after that
is Megatron's: ``initialize_megatron`` (gloo), the model builder, its
``DistributedDataParallel`` and optimizer (torch AdamW: no Apex or Transformer Engine), the
data loaders, ``train()`` (which powerlib patches) and ``evaluate()``.

CPU only through torch-level shims (``megatron_shims.pretrain_on_cpu``; stock Megatron asserts
CUDA). Its sibling imports (``megatron_shims``, ``clocked``) are what ``pretrain_gpt.py``'s
``gpt_builders`` is to it: they import only when the launcher puts this folder on ``sys.path``.
Each stage's output passes through ``clocked.Delay`` (an identity that sleeps for the simulated
clock in force). Writes ``$PRETRAIN_OUT/rank<R>.json``: every loss the loss function returned, in
order, and what the powerlib session did (``null`` when powerlib was off).
"""

from __future__ import annotations

import json
import os
import warnings
from functools import partial
from pathlib import Path

import megatron_shims as shims  # a sibling module, like pretrain_gpt.py's gpt_builders
import torch
from clocked import Delay

with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed"
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.enums import ModelType
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training import get_args, pretrain
    from megatron.training.argument_utils import (
        gpt_config_from_args,
        pretrain_cfg_container_from_args,
    )
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

import powerlib
from powerlib.integrations.megatron import current_session

LOSSES: list[list[float]] = []
"""``[loss, tokens]`` of every call of the loss function (the last stage's), in order."""
SESSIONS: list[powerlib.Session] = []


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """pretrain_gpt.py's: the masked sum of the per-token losses, and the token count."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    LOSSES.append([loss.item(), int(num_tokens)])
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    """pretrain_gpt.py's forward step (TP=1, no context parallelism)."""
    session = current_session()
    if session is not None and session not in SESSIONS:
        SESSIONS.append(session)
    tokens = labels = loss_mask = attention_mask = position_ids = None
    if is_first_or_last_pipeline_stage(None):
        batch = next(data_iterator)
        tokens, labels, loss_mask = batch["tokens"], batch["labels"], batch["loss_mask"]
        attention_mask, position_ids = batch.get("attention_mask"), batch["position_ids"]
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    # a copy, not Delay's view: the schedule frees each stage's output (deallocate_pipeline_outputs)
    return Delay.apply(output).clone(), partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """pretrain_gpt.py's, on ``MockGPTDataset``."""
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None,
        blend_per_split=None,
        split=args.split,
        tokenizer=build_tokenizer(args),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )
    return BlendedMegatronDatasetBuilder(
        MockGPTDataset,
        train_val_test_num_samples,
        lambda: is_first_or_last_pipeline_stage(vp_stage),
        config,
    ).build()


def _session_report() -> dict | None:
    """What the session the launcher's patch ran did (``None``: powerlib was off)."""
    if not SESSIONS:
        return None
    session = SESSIONS[-1]
    plan = session.plan
    return {
        "sessions": len(SESSIONS),
        "phase": session.phase,
        "iterations": session.iteration,
        "applied_from": session.apply_started_iteration,
        "profiled_freqs_mhz": list(session.report().profiled_freqs_mhz),
        "order_source": plan.workload.get("order_source") if plan else None,
        "plan_stage": [
            [p.instruction.kind, p.instruction.microbatch, p.freq_mhz]
            for p in plan.stage(session.stage)
        ]
        if plan
        else None,
        "stage": session.stage,
        "num_microbatches": session.config.workload.num_microbatches,
    }


if __name__ == "__main__":
    rank = int(os.environ["RANK"])
    Delay.device = powerlib.open_backend().device(int(os.environ["LOCAL_RANK"]))
    before = Delay.device.read_state().locked_sm_freqs_mhz
    train_valid_test_datasets_provider.is_distributed = True
    with shims.pretrain_on_cpu():
        args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
        full_config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
        pretrain(
            full_config,
            train_valid_test_datasets_provider,
            ModelType.encoder_or_decoder,
            forward_step,
        )
    result = {
        "rank": rank,
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "losses": LOSSES,
        "train_iters": args.train_iters,
        "session": _session_report(),
        "restored": Delay.device.read_state().locked_sm_freqs_mhz == before,
    }
    Path(os.environ["PRETRAIN_OUT"], f"rank{rank}.json").write_text(json.dumps(result))
