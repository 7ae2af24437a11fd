"""`--loss-log`: the training loss of every iteration and every evaluation pass, as a JSON file,
recorded where the loss function computes them (Megatron's log line averages over
--log-interval). One LossLog per run, handed to the forward step and the evaluation hook.
"""

from __future__ import annotations

import json
import math
import os
from functools import partial

import torch

from . import runtime

class LossLog:
    """Per-iteration training losses and per-pass evaluation losses of one run: each rank keeps
    its (loss sum, token count) as detached tensors (no host sync in the loop); finalize() sums
    them over DP x CP, the token-weighted loss Megatron reports. Evaluation passes close at the
    `non_loss_data_func` hook, labelled by data iterator in order of first use: "valid", "test".
    """

    def __init__(self):
        self.train = {}  # iteration -> tensor([loss sum, tokens])
        self.evals = []  # (split, iteration, tensor([loss sum, tokens]))
        self._pending = None
        self._pending_split = None
        self._iterator_labels = {}
        self.last_train_iteration = None

    def split_of(self, data_iterator) -> str:
        key = id(data_iterator)
        if key not in self._iterator_labels:
            n = len(self._iterator_labels)
            self._iterator_labels[key] = ("valid", "test")[n] if n < 2 else f"eval{n}"
        return self._iterator_labels[key]

    def reporter(self, training: bool, iteration: int, data_iterator):
        """The callable the loss function hands each micro-batch's tensor([loss sum, tokens])."""
        split = None if training else self.split_of(data_iterator)
        return partial(self.add, training, iteration, split=split)

    def add(self, training: bool, iteration: int, report: torch.Tensor, split=None):
        """`report`: tensor([loss sum, tokens]) of one micro-batch on this rank."""
        report = report.detach().double()
        if training:
            self.train[iteration] = report if iteration not in self.train else self.train[iteration] + report
            self.last_train_iteration = iteration
        elif self._pending is None:
            self._pending, self._pending_split = report, split
        else:
            self._pending = self._pending + report

    def close_eval(self, iteration: int):
        """End of one evaluate() call."""
        if self._pending is not None:
            self.evals.append((self._pending_split, iteration, self._pending))
        self._pending = None
        self._pending_split = None

    def close_eval_pass(self, model):
        """Megatron's `non_loss_data_func`: called once at the end of every evaluate()."""
        self.close_eval(self.last_train_iteration or _loaded_iteration())
        return None

    def finalize(self, group=None) -> dict:
        """Reduce over `group` (a collective: every rank of the group calls it) -> the record."""
        iterations = sorted(self.train)
        parts = [self.train[it] for it in iterations] + [e[2] for e in self.evals]
        values = []
        if parts:
            flat = torch.stack([p.to(parts[0].device) for p in parts])
            if torch.distributed.is_initialized():
                torch.distributed.all_reduce(flat, group=group)
            values = flat.cpu().tolist()
        train, evals = [], []
        for (s, n), it in zip(values, iterations):
            train.append({"iteration": it, "loss": s / max(n, 1.0), "tokens": int(n)})
        for (s, n), (split, it, _) in zip(values[len(iterations):], self.evals):
            loss = s / max(n, 1.0)
            evals.append({"split": split, "iteration": it, "loss": loss,
                          "ppl": math.exp(min(loss, 50.0)), "tokens": int(n)})
        return {"train": train, "eval": evals}

    def write(self, path: str, extra: dict) -> None:
        """Reduce (every rank calls it) and write `path` from one rank of the last stage.

        `extra` (the Mix-LN placement, the model shape) is merged into the record.
        """
        from megatron.core import mpu  # heavy

        if not torch.distributed.is_initialized() or not mpu.model_parallel_is_initialized():
            return
        record = self.finalize(group=mpu.get_data_parallel_group(with_context_parallel=True))
        writer = (
            mpu.is_pipeline_last_stage(ignore_virtual=True)
            and mpu.get_tensor_model_parallel_rank() == 0
            and mpu.get_data_parallel_rank(with_context_parallel=True) == 0
        )
        if not writer:
            return
        record.update(extra)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, path)


def _loaded_iteration() -> int:
    """The iteration a resumed run starts from (an evaluation before any training step)."""
    return int(runtime.arg("iteration", 0))
