"""``CPTrainer``: transformers' ``Trainer`` with the loss computed by ``cp_forward``.

What the plain ``Trainer`` gets wrong under context parallelism, and what changes here:

- its data loader splits batches over every rank, so the ranks of a cp group get different
  batches; here each dp group (the ranks that share ``dp_replicate`` and ``fsdp`` coordinates)
  takes one shard of the data, the same on all of its ranks;
- it wraps the model in DDP across every rank; cpshard's gradients are already reduced over the
  ranks that hold other tokens (plain autograd, see ``cpshard.value_and_grad``), so nothing wraps it;
- it counts ``num_items_in_batch`` over every rank, cp times too many; here over the dp groups only
  (``cpshard.count_label_tokens``), and the loss is the step's token-loss sum over that count;
- so it counts ``num_input_tokens_seen`` (``include_num_input_tokens_seen``); here each dp group's once;
- it saves each rank's own weights; here ``cpshard.save_pretrained`` gathers sharded ones first;
- its evaluation gathers every rank's predictions, cp (and tp) times each; here each dp group's once: the
  logits gathered whole over cp on each rank, ``preprocess_logits_for_metrics`` and ``compute_metrics``
  then as the plain ``Trainer`` applies them; ``predict`` reads the test set as the eval set.

Checkpoints resume as the plain ``Trainer``'s do (model, optimizer, schedule, RNG, data position): a plain
model's optimizer state is the same on every rank, and ``Trainer`` saves it from rank 0; a parallelized
model's (DTensors like its sharded parameters) is saved by every rank, its own shards
(:mod:`cpshard.parallel.optimizer_state`), and its whole saved weights are cut back into shards on resume.
"""

from __future__ import annotations

import functools
import itertools
import os

import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, Sampler

try:
    import accelerate  # noqa: F401 - transformers' Trainer runs on it
    from transformers import Trainer
    from transformers.trainer import SCHEDULER_NAME
except ImportError as error:
    raise ImportError(
        f"cpshard.integrations.transformers needs transformers' Trainer and accelerate ({error}); "
        "install the extra: pip install 'cpshard[trainer]'"
    ) from error

from cpshard.loss.cross_entropy import IGNORE_INDEX
from cpshard.parallel.checkpoint import load_whole_weights, save_pretrained
from cpshard.parallel.mesh import DATA_AXES, mesh_size
from cpshard.parallel.optimizer_state import load_optimizer_state, save_optimizer_state
from cpshard.runtime.batch import without_varlen_keys
from cpshard.runtime.count import count_label_tokens
from cpshard.runtime.forward import make_cp_forward, params_of

#: the folder of a checkpoint that holds a parallelized model's optimizer state (every rank's shards)
SHARDED_OPTIMIZER = "optimizer_shards"


def dp_group_of(mesh) -> tuple[int, int]:
    """``(index, count)``: which of the mesh's dp groups this rank belongs to, and how many there are."""
    index, count = 0, 1
    for axis in DATA_AXES:
        size = mesh_size(mesh, axis)
        index, count = index * size + (mesh.get_local_rank(axis) if size > 1 else 0), count * size
    return index, count


def copies_of_each_batch(mesh) -> int:
    """How many ranks hold each dp group's batch (its cp and tp ranks): what a sum over every rank of
    per-batch counts is too many by."""
    return torch.distributed.get_world_size() // dp_group_of(mesh)[1]


def _check_trl_mixin(trainer: type) -> None:
    """A TRL trainer mixed into ``CPTrainer`` by hand computes its loss and metrics with a fused LM head that
    cp does not run: refused, naming the classes that serve TRL."""
    trl = [base for base in trainer.__mro__ if base.__module__.split(".")[0] == "trl"]
    if trl and not trainer.serves_trl:
        raise TypeError(
            f"{trainer.__name__} mixes CPTrainer with TRL's {trl[0].__name__}, whose loss and metrics come "
            "from a fused LM head that cp does not run: use cpshard.integrations.trl's CPSFTTrainer or "
            "CPDPOTrainer (SFT and DPO); TRL's other trainers (GRPO, RLOO, KTO, ...) are not served yet"
        )


def _collated(collator, rows: list) -> dict:
    """The collator's batch as cp_forward takes it: a packing collator's varlen keys checked and dropped."""
    return without_varlen_keys(collator(rows))


def _repeats_ignored(batch: dict, sampler: DistributedSampler, first: int, rows: int) -> dict:
    """``batch`` (rows ``first`` to ``first + rows - 1`` of this dp group's shard) with no label on the rows
    the sampler repeated to even out the shards: it pads them with rows from the start where the dp groups
    do not divide the data, and one process trains on each row once. Row ``i`` of a shard is position
    ``rank + i * num_replicas`` of the padded order, a repeat past the data's length."""
    repeated = [
        row
        for row in range(rows)
        if sampler.rank + (first + row) * sampler.num_replicas >= len(sampler.dataset)
    ]
    if not repeated:
        return batch
    keys = [key for key in ("labels", "shift_labels") if batch.get(key) is not None]
    return {**batch, **{key: batch[key].index_fill(0, torch.tensor(repeated), IGNORE_INDEX) for key in keys}}


class _RowsAfter(Sampler):
    """The shard's rows after its first ``skipped`` (a resumed epoch's, whose first batches were trained); its
    epoch is the shard's (set before each pass, so that the rows skipped are that epoch's)."""

    def __init__(self, shard: DistributedSampler, skipped: int):
        self.shard, self.skipped = shard, skipped

    def __iter__(self):
        return itertools.islice(iter(self.shard), self.skipped, None)

    def __len__(self) -> int:
        return max(len(self.shard) - self.skipped, 0)


class _EpochLoader(DataLoader):
    """A data loader over a dp group's shard of the rows (from row ``skipped`` of it on, where a resumed
    epoch skips what it trained): its ``set_epoch`` (which Trainer calls at each epoch) reshuffles the shard,
    it serves the rows the shard repeats without labels (:func:`_repeats_ignored`), and it says how many rows
    its last batch holds while it serves that batch."""

    #: the rows of the batch being served where it is the last (it may hold fewer than the batch size)
    final_rows: int | None = None

    def __init__(self, dataset, shard: DistributedSampler, skipped: int = 0, **options):
        super().__init__(dataset, sampler=_RowsAfter(shard, skipped), **options)
        self.shard, self.skipped = shard, skipped

    def set_epoch(self, epoch: int) -> None:
        self.shard.set_epoch(epoch)

    def __iter__(self):
        batches = len(self)
        for number, batch in enumerate(super().__iter__()):
            first = number * self.batch_size
            left = len(self.sampler) - first
            self.final_rows = left if number == batches - 1 else None
            yield _repeats_ignored(batch, self.shard, self.skipped + first, min(self.batch_size, left))
        self.final_rows = None

    def resumed(self, batches: int) -> _EpochLoader:
        """This loader without its first ``batches`` batches, their rows not read."""
        options = dict(batch_size=self.batch_size, collate_fn=self.collate_fn, drop_last=self.drop_last)
        return _EpochLoader(self.dataset, self.shard, self.skipped + batches * self.batch_size, **options)


class CPTrainer(Trainer):
    """A ``Trainer`` whose loss is ``cp_forward``'s on ``mesh`` (``cpshard.make_mesh``); the model may be
    ``cpshard.parallelize``d first. ``forward``: options of ``cpshard.make_cp_forward`` (e.g.
    ``logits=False``). Everything else is ``Trainer``'s."""

    #: whether this class computes the loss of the TRL trainer it mixes in (cpshard.integrations.trl)
    serves_trl = False

    def __init__(self, model, args=None, *, mesh, forward: dict | None = None, **kwargs):
        _check_trl_mixin(type(self))
        self.mesh = mesh
        self.cp_forward = make_cp_forward(model, **self._forward_options(args, forward or {}))
        super().__init__(model, args=args, **kwargs)
        unsupported = {  # what would otherwise be ignored, silently
            "compute_loss_func": self.compute_loss_func is not None,
            "label_smoothing_factor": self.label_smoother is not None,
        }
        if any(unsupported.values()):
            raise ValueError(
                "CPTrainer computes cp_forward's cross-entropy; it does not take "
                f"{', '.join(name for name, given in unsupported.items() if given)}: for another objective, "
                "subclass it and override compute_loss with make_cp_forward(model, token_logprobs=True)"
            )
        #: whether the model is parallelized: its optimizer state is then each rank's own shards
        self.sharded = any(isinstance(p, DTensor) for p in model.parameters())
        # the model owns its gradient reduction: Trainer then does not wrap it in DDP (transformers' path for
        # models sharded at load time)
        self.is_distributed_loading_by_transformers = True
        self.model_accepts_loss_kwargs = True  # cp_forward takes num_items_in_batch, whatever the model

    def _forward_options(self, args, forward: dict) -> dict:
        """The options of ``make_cp_forward`` for the model's loss: the user's (subclasses add theirs)."""
        return forward

    def _sync_replicated_trainable_parameters(self, model) -> None:
        """Nothing to average: cp_forward's gradients are already reduced over the ranks."""

    def _data_loader(self, dataset, batch_size: int, shuffle: bool) -> DataLoader:
        index, count = dp_group_of(self.mesh)
        sampler = DistributedSampler(
            dataset, num_replicas=count, rank=index, shuffle=shuffle, seed=self.args.seed, drop_last=False
        )
        collator = self._get_collator_with_removed_columns(self.data_collator, description="cp")
        return _EpochLoader(
            dataset,
            sampler,
            batch_size=batch_size,
            collate_fn=functools.partial(_collated, collator),
            drop_last=self.args.dataloader_drop_last,
        )

    def get_train_dataloader(self) -> DataLoader:
        """One shard of the data per dp group, the same on every rank of it (shuffled alike on each)."""
        if self.train_dataset is None:
            raise ValueError("CPTrainer: training requires a train_dataset")
        shuffle = self.args.train_sampling_strategy != "sequential"
        loader = self._data_loader(self.train_dataset, self._train_batch_size, shuffle)
        if len(self.train_dataset) % dp_group_of(self.mesh)[1]:
            self._check_rows_keep_their_labels(loader)
        return loader

    def _check_rows_keep_their_labels(self, loader: _EpochLoader) -> None:
        """Where the dp groups do not divide the rows, the repeats go without labels: a ValueError (on every
        rank alike, before training) unless a batch of the collator's keeps a label row per data row (a
        padding-free collator packs its rows into one, whose repeated part cannot be told apart)."""
        rows = min(2, loader.batch_size, len(loader.dataset))
        batch = loader.collate_fn([loader.dataset[i] for i in range(rows)])
        labels = next((batch[key] for key in ("labels", "shift_labels") if batch.get(key) is not None), None)
        if labels is None or labels.shape[0] != rows:
            count = dp_group_of(self.mesh)[1]
            raise ValueError(
                f"{type(self).__name__}: {len(loader.dataset)} training rows do not divide over {count} dp "
                "groups, whose shards the sampler evens out with repeated rows, served without labels; this "
                f"collator gives {rows} rows {'no labels' if labels is None else 'packed in one'}, so the "
                f"repeats would be trained twice: use a multiple of {count} rows"
            )

    def get_resumed_dataloader(self, dataloader: DataLoader, num_batches: int) -> DataLoader:
        """The training loader without the batches a resumed epoch trained (accelerate's skip would make a
        plain loader: the shard's repeats then trained with their labels, and its epoch never set)."""
        return dataloader.resumed(num_batches)

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, str):
            dataset = self.eval_dataset[dataset]
        if dataset is None:
            raise ValueError("CPTrainer: evaluation requires an eval_dataset")
        return self._evaluation_loader(dataset)

    def get_test_dataloader(self, test_dataset) -> DataLoader:
        """The test set as the eval set: one shard per dp group, the same on every rank of it."""
        return self._evaluation_loader(test_dataset)

    def _evaluation_loader(self, dataset) -> DataLoader:
        """One shard per dp group; refused (on every rank alike) where the dp groups do not divide the rows:
        the sampler would pad the shards with repeated rows, counted twice in the loss and the metrics."""
        self._check_dp_groups_divide(dataset, "evaluation rows", "counted twice in the loss and the metrics")
        return self._data_loader(dataset, self.args.eval_batch_size, shuffle=False)

    def _check_dp_groups_divide(self, dataset, rows: str, why: str) -> None:
        """A ValueError (on every rank alike) where the dp groups do not divide ``dataset``'s rows: the
        sampler would pad each group's shard with repeated rows, ``why`` that is wrong."""
        count = dp_group_of(self.mesh)[1]
        if len(dataset) % count:
            raise ValueError(
                f"{type(self).__name__}: {len(dataset)} {rows} do not divide over {count} dp groups; each "
                f"group's shard would be padded with repeated rows, {why}: use a multiple of {count} rows"
            )

    def evaluation_loop(self, dataloader, *args, **kwargs):
        """Trainer's loop, its gathers keeping each dp group's predictions once (it resets them after)."""
        self.gather_function = functools.partial(self._gathered_once_per_dp_group, dataloader)
        return super().evaluation_loop(dataloader, *args, **kwargs)

    def _gathered_once_per_dp_group(self, loader, tensors):
        """Every rank's ``tensors`` gathered, then the copies of the other cp and tp ranks of each dp group
        dropped (their batches are the same), in dp-group order. In a last batch shorter than the batch
        size, at most its rows: Trainer repeats each batch's loss batch-size times, and accelerate's
        ``gather_for_metrics`` (on the loaders it prepares) cuts the repeats past the data's end."""
        gathered = self.accelerator.gather(tensors)
        # the global ranks by mesh axis, gathered in rank order: the first cp and tp rank of each dp group
        index = tuple(0 if axis in ("cp", "tp") else slice(None) for axis in self.mesh.mesh_dim_names)
        keep, world = self.mesh.mesh[index].flatten(), self.mesh.mesh.numel()
        rows = getattr(loader, "final_rows", None)
        most = None if rows is None else rows * dp_group_of(self.mesh)[1]

        def once(x):
            if isinstance(x, torch.Tensor):
                return x.view(world, -1, *x.shape[1:])[keep].flatten(0, 1)[:most]
            if isinstance(x, list | tuple):
                return type(x)(once(item) for item in x)
            if isinstance(x, dict):
                return {key: once(value) for key, value in x.items()}
            return x

        return once(gathered)

    def _get_num_items_in_batch(self, batch_samples: list, device):
        """The label tokens of the step's micro-batches over the dp groups (not over cp and tp ranks)."""
        if not batch_samples or "labels" not in batch_samples[0] and "shift_labels" not in batch_samples[0]:
            return None
        return count_label_tokens(batch_samples, self.mesh).to(device)

    def _track_num_input_tokens(self, inputs) -> None:
        """Trainer's count of the input tokens seen, each dp group's once: its gather sums every rank's
        count, and the ranks of a dp group (its cp and tp ranks) hold the same batch."""
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        copies = copies_of_each_batch(self.mesh)
        self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // copies

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """cp_forward's loss: the same on every rank, over the step's ``num_items_in_batch`` when given."""
        batch = dict(inputs)
        if num_items_in_batch is not None:
            batch["num_items_in_batch"] = num_items_in_batch
        output = self.cp_forward(params_of(self.accelerator.unwrap_model(model)), batch, self.mesh)
        return (output.loss, output) if return_outputs else output.loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The loss of the whole eval batch over every dp group; unless ``prediction_loss_only``, this dp
        group's logits (gathered whole over cp, on every rank of it) and labels, as Trainer's."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss, output = self.compute_loss(model, inputs, return_outputs=True)
        if prediction_loss_only:
            return loss.detach(), None, None
        if output.logits is None:
            raise ValueError(
                "CPTrainer: predictions need the logits, which forward={'logits': False} does not make; set "
                "prediction_loss_only=True (the loss alone) or leave logits on"
            )
        return loss.detach(), output.logits.full_tensor(), inputs.get("labels")

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """A parallelized model's optimizer state written by every rank, its own shards; else Trainer's."""
        if not self.sharded:
            return super()._save_optimizer_and_scheduler(output_dir)
        model = self.accelerator.unwrap_model(self.model)
        save_optimizer_state(self.optimizer, model, os.path.join(output_dir, SHARDED_OPTIMIZER))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """A parallelized model's optimizer state read back into shards placed like its parameters (nothing
        where the checkpoint has none: ``save_only_model``, as with Trainer); else Trainer's."""
        if not self.sharded or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if not os.path.isdir(os.path.join(checkpoint, SHARDED_OPTIMIZER)):
            return
        model = self.accelerator.unwrap_model(self.model)
        load_optimizer_state(self.optimizer, model, os.path.join(checkpoint, SHARDED_OPTIMIZER))
        scheduler = torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True)
        self.lr_scheduler.load_state_dict(scheduler)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """A parallelized model's whole saved weights (:meth:`_save`'s) cut into each rank's shards (no
        communication); else Trainer's."""
        if not self.sharded:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        model = self.accelerator.unwrap_model(model if model is not None else self.model)
        load_whole_weights(model, resume_from_checkpoint)

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """The whole weights (sharded ones gathered on every rank) as ``from_pretrained`` loads them."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        model = self.accelerator.unwrap_model(self.model)
        save_pretrained(model, params_of(model), output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
