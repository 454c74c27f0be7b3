"""A user's classifier that reports metrics of its own (trainer/report.py), written into a workspace
folder by the tests (data for them, imported by the trainer from the workspace)."""

from tests.trainer.user_model_src import USER_CNN

USER_METRICS = (
    USER_CNN
    + '''
import torch.nn.functional as F
from trainer.report import evaluating, report


class Scored(CNN):
    """The CNN, reporting its accuracy (training batches) and val_accuracy (validation batches),
    and from its data the share of class 0 in each batch."""

    def loss(self, outputs, targets):
        acc = (outputs.argmax(-1) == targets).float().mean()
        report("val_accuracy" if evaluating() else "accuracy", acc)
        return F.cross_entropy(outputs, targets)


def scored(*, width=8, n_classes=4):
    return Scored(width, n_classes)


def labelled_images(*, batch_size, seq_len, seed, n_classes=4):
    train, val = images(batch_size=batch_size, seq_len=seq_len, seed=seed, n_classes=n_classes)

    def counted(stream):
        for x, y in stream:
            report("data/class0", (y == 0).float().mean())
            yield x, y

    return counted(train), counted(val)


class BadName(CNN):
    def loss(self, outputs, targets):
        report("val_loss", 1.0)
        return F.cross_entropy(outputs, targets)


def bad_name(**kwargs):
    return BadName(8, 4)


class NotFinite(CNN):
    def loss(self, outputs, targets):
        report("ratio", float("nan"))
        return F.cross_entropy(outputs, targets)


def not_finite(**kwargs):
    return NotFinite(8, 4)


class TooMany(CNN):
    def loss(self, outputs, targets):
        for i in range(65):
            report(f"m{i}", i)
        return F.cross_entropy(outputs, targets)


def too_many(**kwargs):
    return TooMany(8, 4)
'''
)
