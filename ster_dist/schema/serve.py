"""serve: the model behind an OpenAI-compatible HTTP server, with Ster's serve API beside it."""

from __future__ import annotations

import ipaddress
import os
import re

from pydantic import ValidationInfo, model_validator

from ster_dist.errors import Refusal
from ster_dist.schema.base import field, label_in
from ster_dist.schema.common import Runtime
from ster_dist.schema.engine_fields import EngineFields, memory_bytes

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and localhost: what no other machine can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ServeRequest(Runtime, EngineFields):
    command = ("serve",)
    summary = "serve the model over HTTP: OpenAI's chat and completions API, steering and adapters per request"
    result_on_stdout = False

    host: str = field(
        "127.0.0.1", help="the address to listen on; any other than loopback needs --api-key"
    )
    port: int = field(0, ge=0, le=65535, help="the port (0: a free one, printed on the ready line)")
    api_key: str | None = field(
        None,
        help="the bearer token every request must carry (default: STER_API_KEY when "
        "set, else none on loopback)",
    )
    served_model_name: str | None = field(
        None, help="the model's name in the API (default: --model as given)"
    )
    vectors: str | None = field(
        None,
        help="a directory of steering artifacts (NAME.json), named by requests' "
        '"steering": {"vector": NAME, "strength": S}',
    )
    adapter: list[str] | None = field(
        None,
        help="NAME=DIR: a LoRA adapter served as model NAME; repeat the flag for several",
        cli={"append": True},
    )
    allow_path: list[str] | None = field(
        None,
        help="a directory whose files Ster's API (/v1/train, /v1/generate, "
        "...) may read and write besides the working directory; "
        "repeat the flag for several",
        cli={"append": True},
    )
    allow_models: list[str] | None = field(
        None,
        help="a model (Hub id or directory) Ster's API may run besides the "
        "served one; repeat the flag for several",
        cli={"append": True},
    )
    max_queue: int = field(
        256,
        ge=1,
        help="requests waiting or running at once, OpenAI's and Ster's API's; more "
        "are answered 429",
    )
    max_body: str = field("4MiB", help="the largest request body accepted, e.g. 1MiB")
    replicas: int = field(
        1, ge=1, help="engine replicas behind the one endpoint (Ray Serve, above 1)"
    )
    drain_seconds: float = field(
        30.0,
        ge=0,
        allow_inf_nan=False,
        help="how long SIGTERM waits for requests in flight before it exits",
    )
    read_seconds: float = field(
        30.0,
        gt=0,
        allow_inf_nan=False,
        help="how long a client may take to send a request's head, and then its body: a "
        "slower head closes the connection, a slower body is answered 408",
    )

    @model_validator(mode="after")
    def _settings(self, info: ValidationInfo):
        if not self.host.strip():
            raise Refusal(
                f"{label_in(info, 'host')} is empty; give 127.0.0.1 or an address of this machine"
            )
        if (
            not is_loopback(self.host)
            and self.api_key is None
            and not os.environ.get("STER_API_KEY")
        ):
            # refused on arrival, as serve/run.py's check_exposure would after the imports and the
            # model load
            raise Refusal(
                f"{label_in(info, 'host')} {self.host} listens beyond this machine; give "
                f"{label_in(info, 'api_key')} KEY (or set STER_API_KEY) so only clients holding it are "
                "answered, or keep the default 127.0.0.1"
            )
        memory_bytes(self.max_body, label_in(info, "max_body"))
        names = set()
        for item in self.adapter or ():
            name, sep, directory = item.partition("=")
            if not sep or not _NAME.fullmatch(name) or not directory:
                raise Refusal(
                    f"{label_in(info, 'adapter')} takes NAME=DIR (a name of letters, digits and ._:/-, "
                    f"then the adapter's directory), got {item!r}"
                )
            if name in names:
                raise Refusal(
                    f"{label_in(info, 'adapter')} names {name!r} twice; give each adapter its own name"
                )
            names.add(name)
        if self.served_model_name is not None and not _NAME.fullmatch(self.served_model_name):
            raise Refusal(
                f"{label_in(info, 'served_model_name')} must be letters, digits and ._:/- (at most 128), "
                f"got {self.served_model_name!r}"
            )
        return self

    def adapters(self) -> dict[str, str]:
        return dict(item.split("=", 1) for item in self.adapter or ())

    def name(self) -> str:
        return self.served_model_name or self.model

    def body_limit(self) -> int:
        return memory_bytes(self.max_body, "max_body")
