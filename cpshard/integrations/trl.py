"""TRL's SFT and DPO trainers under context parallelism: ``CPSFTTrainer`` and ``CPDPOTrainer``.

TRL's trainers take their loss and metrics from a fused LM head (its ``add_fused_lm_head``): the model,
called with ``fused_lm_head=True``, gives per-token log-probabilities, entropies, top-1 hits and mean logits
in place of the logits. Under cp each rank holds a slice of every sequence, so here:

- ``CPSFTTrainer``: the loss is ``cp_forward``'s (TRL's ``loss_type`` "nll"; "dft" weights each token's
  log-probability by its detached probability), over the step's label tokens as ``CPTrainer`` counts them;
  TRL's metrics (entropy, mean token accuracy, tokens) from cp's token statistics, each rank's summed over
  its own slice and the sums gathered over every rank: each token once;
- ``CPDPOTrainer``: TRL's own loss code (every ``loss_type``, ``ld_alpha``, WPO weighting) and metrics run
  on the fused head's per-token fields, which cp serves (the model's and the reference model's) and gathers
  whole over cp (``[2B, L]`` values per field, not the logits); the log-probabilities' gradient flows back to
  each rank's own slice. A dp group's loss is a mean over its pairs; the loss is the mean over the dp
  groups, as one process's over the whole batch.

Refused with a clear error on every rank: an MoE router loss (TRL adds its own per micro-batch), a PEFT
model, DPO's ``precompute_ref_log_probs`` (its loader splits rows over every rank, cp ranks included) and
DPO's predictions (logits of a second forward, deprecated in TRL: ``prediction_loss_only=True``).
"""

from __future__ import annotations

import functools

import torch

try:
    from trl import DPOTrainer, SFTTrainer
    from trl.trainer.utils import FusedCausalLMOutput
except ImportError as error:
    raise ImportError(
        f"cpshard.integrations.trl needs TRL ({error}); install the extra: pip install 'cpshard[trl]'"
    ) from error

from cpshard.integrations.transformers import CPTrainer, copies_of_each_batch, dp_group_of
from cpshard.loss.cross_entropy import IGNORE_INDEX
from cpshard.parallel.mesh import DATA_AXES, TOKEN_AXES, summed_over
from cpshard.runtime.batch import shifted_labels
from cpshard.runtime.forward import make_cp_forward, params_of

#: TRL's fused-head fields, by the cp token statistic that serves each
FUSED_FIELDS = {
    "entropy": "entropy",
    "top1": "is_top1",
    "mean_logit": "mean_logits",
    "log_sum_sq_probs": "log_sum_sq_probs",
}


def as_trl_reads(batch: dict) -> dict:
    """``batch`` with its ``labels`` as ``shift_labels``, shifted as TRL's fused head shifts every model's
    (cp would read them as the model's own loss does, which for a few models is unshifted)."""
    if batch.get("labels") is None:
        return dict(batch)
    return {
        **{key: value for key, value in batch.items() if key != "labels"},
        "shift_labels": shifted_labels(batch["labels"]),
    }


class _CPTRLTrainer(CPTrainer):
    """What the TRL trainers share under cp: the refusals and TRL's count of the tokens seen."""

    serves_trl = True

    def __init__(self, model, args=None, **kwargs):
        if hasattr(model, "peft_config") or kwargs.get("peft_config") is not None:
            raise ValueError(
                f"{type(self).__name__}: a PEFT model (or peft_config) is not served by cpshard's trainers "
                "yet; train whole, or train the adapters in a loop of your own: cpshard.make_cp_forward("
                "peft_model.get_base_model()) serves the model with its adapters in place"
            )
        super().__init__(model, args, **kwargs)
        if getattr(self, "aux_loss_enabled", False):
            raise ValueError(
                f"{type(self).__name__}: TRL adds the MoE router loss of each micro-batch itself, which cp "
                "does not serve yet; set the config's router_aux_loss_coef=0 (or train without TRL's "
                "router loss)"
            )
        # TRL divides its count of the tokens seen (num_tokens, summed over every rank) by the ranks that
        # hold the same batch, which it knows as its tp size: here every rank of a dp group (cp and tp)
        self._tp_size = copies_of_each_batch(self.mesh)


class CPSFTTrainer(_CPTRLTrainer, SFTTrainer):
    """TRL's ``SFTTrainer`` with the loss of ``cp_forward`` on ``mesh``; its metrics as TRL logs them. Takes
    ``SFTTrainer``'s arguments, and ``mesh`` and ``forward`` (options of ``make_cp_forward``) as
    ``CPTrainer``."""

    def _forward_options(self, args, forward: dict) -> dict:
        dft = getattr(args, "loss_type", "nll") == "dft"  # SFTTrainer checks the name
        logprobs = forward.get("token_logprobs", False) or dft
        return {**forward, "token_logprobs": logprobs, "token_statistics": ("entropy", "top1")}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        batch = as_trl_reads(inputs)
        if num_items_in_batch is not None:
            batch["num_items_in_batch"] = num_items_in_batch
        output = self.cp_forward(params_of(self.accelerator.unwrap_model(model)), batch, self.mesh)
        loss = self._dft_loss(output, num_items_in_batch) if self.args.loss_type == "dft" else output.loss
        self._log_token_metrics(mode, output)
        self._count_tokens_seen(mode, inputs)
        return (loss, output) if return_outputs else loss

    def _gathered_sum(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over every rank (each rank's own part: its slice's sum, or its batch's)."""
        return self.accelerator.gather(value.detach().reshape(1)).sum()

    def _dft_loss(self, output, num_items_in_batch) -> torch.Tensor:
        """DFT (arXiv 2508.05629): each token's negated log-probability weighted by its detached probability,
        summed over every rank's slice, over the step's label tokens."""
        logprobs = output.token_logprobs.to_local()
        weighted = -(logprobs * logprobs.exp().detach()).sum()
        count = output.num_tokens if num_items_in_batch is None else num_items_in_batch
        return summed_over(weighted, self.mesh, TOKEN_AXES, "loss") / torch.as_tensor(count).clamp(min=1)

    def _log_token_metrics(self, mode: str, output) -> None:
        """TRL's entropy and mean token accuracy over the label tokens of every dp group's batch."""
        statistics = {name: value.to_local() for name, value in output.token_statistics.items()}
        valid = output.num_tokens
        entropy = self._gathered_sum(statistics["entropy"].sum())
        correct = self._gathered_sum(statistics["top1"].sum())
        self._metrics[mode]["entropy"].append((entropy / valid).item() if valid > 0 else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append((correct / valid).item() if valid > 0 else 0.0)

    def _count_tokens_seen(self, mode: str, inputs: dict) -> None:
        """TRL's ``num_tokens`` metric: the batch's tokens (padding-free rows: their positions), each dp
        group's once."""
        if mode == "train":
            if "attention_mask" in inputs:
                tokens = inputs["attention_mask"].sum()
            else:
                tokens = torch.tensor(inputs["position_ids"].numel())
            self._total_train_tokens += int(self._gathered_sum(tokens)) // self._tp_size
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]


class CPDPOTrainer(_CPTRLTrainer, DPOTrainer):
    """TRL's ``DPOTrainer`` whose model and reference model run under cp on ``mesh``: TRL's loss and metrics
    on their per-token outputs. Takes ``DPOTrainer``'s arguments (``ref_model`` by keyword or second), and
    ``mesh`` and ``forward`` (options of ``make_cp_forward``, for both models) as ``CPTrainer``."""

    def __init__(self, model, ref_model=None, args=None, *, mesh, forward: dict | None = None, **kwargs):
        if getattr(args, "precompute_ref_log_probs", False):
            raise ValueError(
                "CPDPOTrainer: precompute_ref_log_probs=True reads the data with a loader that splits its "
                "rows over every rank, the cp ranks of a group included; leave it False (the reference model "
                "then runs under cp beside the model)"
            )
        super().__init__(model, args, mesh=mesh, forward=forward, ref_model=ref_model, **kwargs)
        serve_fused_head(self.accelerator.unwrap_model(self.model), self.cp_forward, mesh)
        if self.ref_model is not None:
            reference = self.accelerator.unwrap_model(self.ref_model)
            options = self._forward_options(self.args, forward or {})
            serve_fused_head(reference, make_cp_forward(reference, **options), mesh)

    def get_train_dataloader(self):
        """``CPTrainer``'s, refused where the dp groups do not divide the pairs: TRL's loss is each group's
        mean over its pairs, and a pair the sampler repeats cannot be taken out of it by its labels."""
        if self.train_dataset is not None:  # else CPTrainer's own message
            self._check_dp_groups_divide(self.train_dataset, "training pairs", "trained twice")
        return super().get_train_dataloader()

    def _forward_options(self, args, forward: dict) -> dict:
        statistics = ("entropy", "top1", "mean_logit")
        if getattr(args, "use_weighting", False):
            statistics += ("log_sum_sq_probs",)
        return {**forward, "token_logprobs": True, "token_statistics": statistics}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss of this dp group's pairs (the same on its ranks), averaged over the dp groups."""
        if return_outputs:
            raise ValueError(
                "CPDPOTrainer does not give predictions (TRL computes them with a second forward of the "
                "whole sequence, deprecated there): evaluate with prediction_loss_only=True"
            )
        loss = DPOTrainer.compute_loss(self, model, inputs, False, num_items_in_batch)
        return summed_over(loss / dp_group_of(self.mesh)[1], self.mesh, DATA_AXES, "loss")

    prediction_step = DPOTrainer.prediction_step  # the loss alone, through compute_loss


def serve_fused_head(model, cp_forward, mesh) -> None:
    """Make TRL's ``model(..., labels=..., fused_lm_head=True)`` a cp call on ``mesh``: the fused head's
    per-token fields from ``cp_forward`` (``token_logprobs`` and ``token_statistics``), gathered whole over
    cp; every other call (and cp's own, inside) goes to the forward TRL patched in."""
    trl_forward = model.forward

    @functools.wraps(trl_forward)
    def forward(*args, fused_lm_head=False, **kwargs):
        if not fused_lm_head:
            return trl_forward(*args, **kwargs)
        if args or kwargs.get("output_router_logits"):
            raise ValueError("the cp fused head takes keyword inputs, without output_router_logits")
        given = {key: value for key, value in kwargs.items() if key != "use_cache" and value is not None}
        batch = as_trl_reads(given)
        output = cp_forward(params_of(model), batch, mesh)
        return fused_output(output, batch["shift_labels"], shifted="shift_labels" in given)

    model.forward = forward


def fused_output(output, labels: torch.Tensor, shifted: bool) -> FusedCausalLMOutput:
    """TRL's fused-head output from a cp call's: each per-token field whole (``[B, L - 1]`` for labels the
    model shifts, ``[B, L]`` for ``shift_labels``), the log-probabilities with their gradient."""
    kept = slice(None) if shifted else slice(None, -1)
    fields = {FUSED_FIELDS[name]: value for name, value in output.token_statistics.items()}
    whole = {name: value.full_tensor()[:, kept] for name, value in fields.items()}
    return FusedCausalLMOutput(
        loss=output.loss,
        log_probs=output.token_logprobs.full_tensor()[:, kept],
        label_mask=(labels != IGNORE_INDEX)[:, kept],
        **whole,
    )
