"""Test doubles shared by the loop and callback tests."""


class FakeBar:
    """A tqdm stand-in that records what the progress bar does."""

    def __init__(self, **kwargs):
        self.kwargs, self.updates, self.postfixes, self.closed = kwargs, [], [], 0

    def update(self, n):
        self.updates.append(n)

    def set_postfix(self, values, refresh=True):
        self.postfixes.append(dict(values))

    def close(self):
        self.closed += 1


def steps_of(history, split="train"):
    """The steps of the records of one split."""
    return [r["step"] for r in history.records if r["split"] == split]
