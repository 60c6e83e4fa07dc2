"""One replica of `ster batch`: a model loaded once (a session and its token engine) in a Ray Data
actor, answering each batch of rows Ray Data hands it. Every row of a batch is a request of the
engine at once (continuous batching shares the forwards); each row gets what `ster generate`
gives its prompt alone, and the batch comes back in its order with the answer columns added.
"""

from __future__ import annotations

import dataclasses

from ster_dist.batch.rows import plain, row_key, row_request


class Replica:
    """A callable class for `Dataset.map_batches` (batch_format="pandas" or "numpy")."""

    def __init__(
        self,
        model: str,
        runtime: dict | None = None,
        defaults: dict | None = None,
        chat_template: str = "auto",
    ):
        from ster_dist.schema import GenerateRequest
        from ster_dist.session import Session

        self.model, self.defaults, self.chat_template = model, dict(defaults or {}), chat_template
        self.runtime = GenerateRequest.parse(
            {"model": model, "prompt": "-", **(runtime or {})}, check_model=False
        )
        self.session = Session(self.runtime)
        self.engine = self.session.engine(*self.runtime.engine_options())

    def __call__(self, batch):
        rows = _rows(batch)
        streams = [self._submit(row) for row in rows]
        answers = [stream.result() for stream in streams]
        out = {name: [plain(v) for v in _column(batch, name)] for name in _names(batch)}
        out["answer"] = [a.text for a in answers]
        out["prompt_tokens"] = [a.prompt_tokens for a in answers]
        out["completion_tokens"] = [len(a.token_ids) for a in answers]
        out["finish_reason"] = [a.finish_reason for a in answers]
        out["row_key"] = [row_key(row) for row in rows]
        return out

    def _submit(self, row: dict):
        from ster_dist.ops.generate import sampling_params

        request, messages = row_request(row, self.model, self.defaults)
        tokenizer = self.session.tokenizer
        if messages is not None:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        else:
            ids = tokenizer.prompt_ids(request.prompt, None, self.chat_template)
        params = dataclasses.replace(sampling_params(request))
        return self.engine.submit(ids, params)

    def __del__(self):
        session = getattr(self, "session", None)
        if session is not None:
            try:
                session.close()
            except Exception:  # an actor going away: nothing to report to
                pass


def _names(batch) -> list[str]:
    return list(batch.columns) if hasattr(batch, "columns") else list(batch)


def _column(batch, name: str):
    return batch[name].tolist() if hasattr(batch[name], "tolist") else list(batch[name])


def _rows(batch) -> list[dict]:
    names = _names(batch)
    columns = [_column(batch, name) for name in names]
    return (
        [
            {name: plain(values[i]) for name, values in zip(names, columns)}
            for i in range(len(columns[0]))
        ]
        if columns
        else []
    )
