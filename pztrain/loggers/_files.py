"""`JsonlLogger` (records, and text and images: `read_media` reads those
back), and the rules of the file loggers' paths (`log_file`, `log_directory`)
and of their resume (`kept_entries`, `replace_atomically`); `CSVLogger` is in
`pztrain.loggers._csv`.

A file logger takes a directory (its file gets the default name there:
``metrics.jsonl``, ``metrics.csv``) or a file name with its suffix; its
hyperparameters go beside the file. The file is opened when the run starts
(`start_run`, which `pztrain.fit` calls with the step it starts from), or at the
first record: a log that holds records after that step is cut back to it for a
resumed run, and refused otherwise (another run's log is never mixed with this
one's or cut). Every rewrite is atomic: a new file, flushed to disk, renamed
over the old one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pztrain.loggers._media import Image, Text, file_stem, not_media
from pztrain.records import jsonable

__all__ = [
    "JsonlLogger",
    "beside_log",
    "kept_entries",
    "log_directory",
    "log_file",
    "not_a_log",
    "read_media",
    "read_records",
    "replace_atomically",
]

_LOG_SUFFIXES = (".csv", ".jsonl", ".json")  # never made into directories


def log_file(path: str | os.PathLike, name: str, who: str) -> Path:
    """The file a logger given ``path`` writes: ``path`` itself if it ends in
    the suffix of ``name`` (the default file name), else ``path / name``.

    Raises:
      ValueError: naming ``path`` and what to pass instead, if it is a file of
        another kind, or ends in another log suffix, or if the file to write is
        a directory. Nothing has been written then.

    Example:
      >>> log_file("run", "metrics.csv", "CSVLogger").as_posix()
      'run/metrics.csv'
      >>> log_file("run/train.csv", "metrics.csv", "CSVLogger").as_posix()
      'run/train.csv'
    """
    path, suffix = Path(path), Path(name).suffix
    file = path if path.suffix == suffix else log_directory(path, who, name) / name
    if file.is_dir():
        raise ValueError(
            f"{who}({str(path)!r}): {file} is a directory, not a {suffix} file. "
            "Remove or rename it, or pass another path."
        )
    return file


def log_directory(path: str | os.PathLike, who: str, name: str | None = None) -> Path:
    """``path`` as the directory of a logger's files (``name``: its default
    file name, if it also takes one).

    Raises:
      ValueError: if ``path`` is a file, or ends in a log file's suffix
        (``.csv``, ``.jsonl``, ``.json``): no directory gets such a name.
    """
    path = Path(path)
    takes = (
        "a directory"
        if name is None
        else f"a directory ({name} is written in it) or a file name ending in "
        f"{Path(name).suffix}"
    )
    if path.suffix in _LOG_SUFFIXES:
        raise ValueError(
            f"{who}({str(path)!r}): {path.name!r} names a {path.suffix} file, but "
            f"{who} takes {takes}."
        )
    if path.exists() and not path.is_dir():
        raise ValueError(
            f"{who}({str(path)!r}): {path} is a file, not a directory; {who} "
            f"takes {takes}."
        )
    return path


def beside_log(file: Path, default: str, name: str) -> Path:
    """Where a log's hyperparameters go: ``name`` beside the log if it has the
    ``default`` name, else ``<log's stem>.<name>``."""
    return file.with_name(name if file.name == default else f"{file.stem}.{name}")


def kept_entries(path: Path, entries: list[dict], step: int, resumed: bool, kind: str):
    """The entries of a log up to ``step``; later ones only if ``resumed``.

    Raises:
      ValueError: the log holds entries after ``step`` and the run does not
        resume (another run's log), naming the file and what to do.
    """
    if not resumed and any(e["step"] > step for e in entries):
        raise ValueError(
            f"{path} holds another run's log ({len(entries)} {kind}, up to step "
            f"{max(e['step'] for e in entries)}). Continue that run (fit(..., "
            "resume=True) with its checkpoints), pass another path, or move the "
            "file away."
        )
    return [e for e in entries if e["step"] <= step]


def not_a_log(path: Path, who: str, why: str) -> ValueError:
    return ValueError(
        f"{path} is not a log that {who} writes ({why}). Pass another path, or "
        "move the file away."
    )


class JsonlLogger:
    """Writes ``metrics.jsonl`` (one JSON object per record) and ``hparams.json``;
    text and images (`log_media`) go to ``media.jsonl`` and ``images/``.

    Continues a resumed run's log: `pztrain.fit` calls `start_run` with the step it
    starts from, and the records after it are dropped from the file when the
    run resumes from a checkpoint (it redoes them), so a resumed run neither
    repeats nor skips a step. A log that holds records after the start step is
    refused otherwise: another run's log is never mixed with this one's or cut.
    The file is rewritten atomically (a new file, flushed to disk, renamed over
    the old one): a run killed meanwhile leaves the old records or the new
    ones, never an empty file.

    Args:
      run_dir: A directory (created if missing; ``metrics.jsonl`` is written
        in it) or a file name ending in ``.jsonl``. The hyperparameters go beside
        it: ``hparams.json``, or ``<name>.hparams.json`` for a file named
        otherwise than ``metrics.jsonl``.
      resume_step: If given, the log is opened at once, keeping only records
        with ``step <= resume_step`` (``start_run(resume_step, resumed=drop_later)``);
        otherwise at `start_run` or at the first record.
      drop_later: Whether the records after ``resume_step`` may be dropped (a
        run resumed from a checkpoint redoes them); if not, they are refused.

    Attributes:
      path: The log file.
      run_dir: Its directory.
      hparams_path: Where the hyperparameters go.
      media_path: Where text and images are listed (``media.jsonl`` beside the
        log, or ``<name>.media.jsonl``; `read_media` reads it).
      images_dir: Where images go as PNG files (``images``, or
        ``<name>.images``), named ``<key>-<hash>-<step>.png`` (a slug of the key and a
        hash of it: no two keys share a file).

    Raises:
      ValueError: if ``run_dir`` is a file of another kind (named), or the log
        holds records after ``resume_step`` that may not be dropped.

    Example:
      >>> import tempfile; from pztrain import JsonlLogger
      >>> from pztrain.loggers import read_jsonl
      >>> d = tempfile.mkdtemp()
      >>> log = JsonlLogger(d)
      >>> log.log_record({"step": 1, "split": "train", "metrics": {"loss": 0.5}})
      >>> log.close()
      >>> read_jsonl(d)[0]["metrics"]
      {'loss': 0.5}
      >>> log.start_run(0, resumed=True)  # a run resumed from step 0 redoes 1
      >>> log.log_record({"step": 1, "split": "train", "metrics": {"loss": 0.25}})
      >>> log.close()
      >>> [r["metrics"] for r in read_jsonl(d)]
      [{'loss': 0.25}]
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        resume_step: int | None = None,
        drop_later: bool = True,
    ):
        self.path = log_file(run_dir, "metrics.jsonl", "JsonlLogger")
        self.run_dir = self.path.parent
        self.hparams_path = beside_log(self.path, "metrics.jsonl", "hparams.json")
        self.media_path = beside_log(self.path, "metrics.jsonl", "media.jsonl")
        self.images_dir = beside_log(self.path, "metrics.jsonl", "images")
        self._file: Any = None  # opened at the first record
        self._media: Any = None  # opened at the first text or image
        self._started, self._kept, self._media_kept = False, None, None
        self._media_dropped: list[str] = []
        if resume_step is not None:
            self.start_run(resume_step, resumed=drop_later)
            self._open()

    def start_run(self, step: int, *, resumed: bool) -> None:
        """Starts the log of a run that starts at ``step`` (`pztrain.fit` calls
        it before the first record; without it, the first record starts a
        fresh log, and a record after `close` goes on with the same one).

        The files are checked here and cut back at the first record or
        hyperparameters, so that when a logger of the run refuses its log,
        every file is left as it was. The media log is cut back with the
        records: its entries after ``step`` dropped, and their PNG files.

        Args:
          step: The step the run starts from. Records up to it are kept.
          resumed: Whether the run resumes from its checkpoint at ``step``
            after it went on past it: the records after ``step`` are redone,
            so they are dropped. Otherwise (a fresh run, or ``fit(state, ...)``
            going on from ``state.step``) they are another run's: refused.

        Raises:
          ValueError: the log holds records after ``step`` and ``resumed`` is
            false, or the file is not such a log (nothing is written then).
        """
        self.close()
        self._file = self._media = self._kept = self._media_kept = None
        if self.path.exists():
            records = read_records(self.path)
            self._kept = kept_entries(self.path, records, step, resumed, "records")
        if self.media_path.exists():
            media = read_records(self.media_path)
            self._media_kept = kept_entries(
                self.media_path, media, step, resumed, "media entries"
            )
            self._media_dropped = [
                m["image"] for m in media if m["step"] > step and "image" in m
            ]
        self._started = True

    def log_hparams(self, hparams: dict[str, Any]) -> None:
        self._open()
        self.hparams_path.write_text(
            json.dumps(jsonable(hparams), indent=2, sort_keys=True)
        )

    def log_record(self, record: dict[str, Any]) -> None:
        self._open()
        self._file.write(json.dumps(jsonable(record)) + "\n")
        self._file.flush()

    def log_media(self, step: int, media: dict[str, Text | Image]) -> None:
        """Appends text and images to ``media.jsonl`` (see `read_media`): a
        text inline, an image as a PNG file in ``images/`` (its path, relative
        to the log's directory, in the entry).

        Raises:
          TypeError: naming the key, for a value that is not `Text` or `Image`
            (`pztrain.loggers.split_media` makes them).
        """
        for key, value in media.items():
            if not isinstance(value, Text | Image):
                raise not_media("JsonlLogger", key, value)
        self._open()
        entries = [self._media_entry(step, k, v) for k, v in media.items()]
        if self._media is None or self._media.closed:
            self._media = self.media_path.open("a")
        self._media.write("".join(json.dumps(e) + "\n" for e in entries))
        self._media.flush()

    def close(self) -> None:
        for file in (self._file, self._media):
            if file is not None:
                file.close()

    def _media_entry(self, step: int, key: str, value: Text | Image) -> dict:
        if isinstance(value, Text):
            return {"step": step, "key": key, "text": value.text}
        file = self.images_dir / f"{file_stem(key)}-{step}.png"
        self.images_dir.mkdir(parents=True, exist_ok=True)
        replace_atomically(file, value.png())
        image = file.relative_to(self.run_dir).as_posix()
        return {"step": step, "key": key, "image": image}

    def _open(self) -> None:
        """The file, ready to append to: a fresh log if `start_run` was not
        called, cut back to the start step, or the same again after `close`."""
        if not self._started:
            self.start_run(0, resumed=False)
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self._kept is not None:
                text = "".join(json.dumps(r) + "\n" for r in self._kept)
                replace_atomically(self.path, text)
                self._kept = None
            if self._media_kept is not None:
                text = "".join(json.dumps(r) + "\n" for r in self._media_kept)
                replace_atomically(self.media_path, text)
                for image in self._media_dropped:
                    (self.run_dir / image).unlink(missing_ok=True)
                self._media_kept, self._media_dropped = None, []
            self._file = self.path.open("a")
        elif self._file.closed:
            self._file = self.path.open("a")


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a `JsonlLogger` 's file, each a dict with an integer
    ``"step"`` (a last line cut short by a kill is none).

    Raises:
      ValueError: naming the file and the line, if it is not such a log.
    """
    *complete, last = path.read_text().split("\n")
    records = []
    for i, line in enumerate([*complete, last]):
        try:
            record = json.loads(line) if line else None
        except ValueError as e:
            if i == len(complete):  # the last line, cut short: not a record
                break
            raise not_a_log(path, "JsonlLogger", f"line {i + 1}: {e}") from None
        if record is None:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            why = f"line {i + 1} is no record with an integer 'step'"
            raise not_a_log(path, "JsonlLogger", why)
        records.append(record)
    return records


def read_media(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The text and images a `JsonlLogger` wrote (its ``media.jsonl``).

    Args:
      run_dir: What the logger was given: its directory, or its ``.jsonl`` file.

    Returns:
      One dict per value, in the order logged: ``{"step", "key", "text"}`` for
      a text, ``{"step", "key", "image"}`` for an image (``image``: the PNG
      file's `pathlib.Path`, as its entry names it: logs written before image
      files had a hash in their names read as they were written). Empty if the
      run logged none.

    Raises:
      FileNotFoundError: if there is no log there at all (naming the path).

    Example:
      >>> import tempfile, numpy as np
      >>> from pztrain.loggers import Image, JsonlLogger, Text, read_media
      >>> d = tempfile.mkdtemp()
      >>> log = JsonlLogger(d)
      >>> log.log_media(5, {"sample": Text("The cat"), "grey": Image(np.eye(2))})
      >>> log.close()
      >>> [(m["step"], m["key"]) for m in read_media(d)]
      [(5, 'sample'), (5, 'grey')]
      >>> read_media(d)[0]["text"], read_media(d)[1]["image"].name
      ('The cat', 'grey-67fc36385b-5.png')
    """
    path = log_file(run_dir, "metrics.jsonl", "read_media")
    media_path = beside_log(path, "metrics.jsonl", "media.jsonl")
    if not media_path.exists():
        if not path.exists():
            raise FileNotFoundError(
                f"read_media({str(run_dir)!r}): no log there ({path} is missing)."
            )
        return []
    entries = read_records(media_path)
    for entry in entries:
        if "image" in entry:
            entry["image"] = path.parent / entry["image"]
    return entries


def replace_atomically(path: Path, text: str | bytes) -> None:
    """Writes ``text`` to a new file, flushes it to disk, renames it to ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb" if isinstance(text, bytes) else "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
