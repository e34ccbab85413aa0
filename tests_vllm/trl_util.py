"""TRL's GRPO with vLLM colocated, offline: a tiny random Llama with its tokenizer made on
the fly, a dataset made in memory, and a trainer small enough to run 3 steps on a CPU."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import engine_util as eu
import torch

VOCAB = 256


def model_dir(path: Path, seed: int = 0, **config: Any) -> Path:
    """The tiny random Llama of the engine tests (float32), or one of the sizes in
    `config` (`LlamaConfig` fields), with a word-level tokenizer over its ids, saved
    where TRL and vLLM load them from."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if config:
        torch.manual_seed(seed)
        cfg = LlamaConfig(tie_word_embeddings=False, max_position_embeddings=256,
                          initializer_range=0.02, **config)
        LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    else:
        eu.hf_model(path, seed)
    size = int(config.get("vocab_size", VOCAB))
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
    )
    fast.save_pretrained(path)
    return path


def dataset(n: int = 8) -> Any:
    """Prompts of 6 to 13 words, in memory."""
    from datasets import Dataset

    prompts = [" ".join(f"w{3 + (7 * i + j) % 200}" for j in range(6 + i % 8)) for i in range(n)]
    return Dataset.from_dict({"prompt": prompts})


def reward(completions: list[str], **_: Any) -> list[float]:
    """A reward that varies between completions (so GRPO's advantages are not all 0)."""
    return [float(len(c) % 7) for c in completions]


def trainer(path: Path, out: Path, *, steps: int = 3, callbacks: list[Any] | None = None
            ) -> Any:
    """A `GRPOTrainer` on the model at `path`, vLLM colocated, float32 on the CPU."""
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-2,  # large: each step moves the weights visibly
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=128,
        vllm_gpu_memory_utilization=0.1,
        model_init_kwargs={"dtype": torch.float32},
        dataloader_num_workers=0,
    )
    return GRPOTrainer(
        model=str(path), reward_funcs=reward, args=args, train_dataset=dataset(),
        callbacks=callbacks,
    )


def float32_engine(**extra: Any) -> Callable[[], None]:
    """TRL builds its colocated `LLM` without a dtype, and vLLM runs a float32 checkpoint
    in bfloat16 on a CPU: the engine TRL builds from now on gets `dtype="float32"` and a
    16 MiB KV cache (and `extra`); returns the function that restores TRL's `LLM`."""
    from trl.generation import vllm_generation
    from vllm import LLM

    def llm(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("gpu_memory_utilization", None)
        return LLM(*args, **{**kwargs, "dtype": "float32",
                             "kv_cache_memory_bytes": 16 << 20, **extra})

    vllm_generation.LLM = llm

    def restore() -> None:
        vllm_generation.LLM = LLM

    return restore


def after_each_sync(check: Callable[[Any], None]) -> Callable[[], None]:
    """Run `check(generation)` right after every TRL sync (outermost, after graphsafe's
    update has ended); returns the function that restores TRL's method."""
    from trl.generation.vllm_generation import VLLMGeneration

    sync = VLLMGeneration.sync_weights

    def sync_weights(self: Any, *args: Any, **kwargs: Any) -> Any:
        ret = sync(self, *args, **kwargs)
        check(self)
        return ret

    VLLMGeneration.sync_weights = sync_weights

    def restore() -> None:
        VLLMGeneration.sync_weights = sync

    return restore
