"""Model zoo: plain-JAX training steps (MLP, GPT, LLaMA, GShard MoE, BERT) wrapped as Workloads."""
from cfp.models.bert import BertConfig
from cfp.models.common import param_count
from cfp.models.gpt import GPTConfig
from cfp.models.llama import LlamaConfig
from cfp.models.mlp import MLPConfig
from cfp.models.moe import MoEConfig
from cfp.models.optim import AdamState, adam_init, adam_update
from cfp.models.registry import (
    DEFAULT_PRESET,
    MODEL_NAMES,
    OVERRIDE_NAMES,
    PRESETS,
    default_batch_size,
    get_workload,
    make_workload,
)
from cfp.models.workload import Workload, make_train_step, user_workload

__all__ = [
    "AdamState",
    "BertConfig",
    "DEFAULT_PRESET",
    "GPTConfig",
    "LlamaConfig",
    "MLPConfig",
    "MODEL_NAMES",
    "MoEConfig",
    "OVERRIDE_NAMES",
    "PRESETS",
    "Workload",
    "adam_init",
    "adam_update",
    "default_batch_size",
    "get_workload",
    "make_train_step",
    "make_workload",
    "param_count",
    "user_workload",
]
