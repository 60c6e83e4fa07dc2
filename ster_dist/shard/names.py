"""Which rule of a family's spec owns a checkpoint tensor, by its name: the one matching the plan,
the merge writer and adapter placement all use, so they agree on it, and what follows from the name
alone (Owner).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ster_dist.config.file import text_weight_names
from ster_dist.families.spec import FamilySpec, Rule, halved, target_name


@dataclass(frozen=True)
class Owner:
    """A checkpoint name's rule and what follows from the name alone, the same on every rank: the
    matched template's groups, the layer, the parameter the tensor fills first (where it belongs: a
    pipeline stage's question), and for a rule with one target the parameter, the expert ({e}) or
    stacked row ({h}) it fills."""

    rule: Rule
    groups: dict
    layer: str | None
    first: str
    param: str | None = None
    expert: int | None = None
    row: int | None = None


class NameMatcher:
    """A checkpoint name -> the spec's first rule whose template matches it (trying the name with
    the spec's optional prefix too), and whether the spec ignores the name. The plan, the merge
    writer and adapter placement all match names through it, so they agree on which rule owns a
    tensor.

    Inside a text wrapper (`wrapper`, ModelConfig.wrapper) a name is matched as the text model's
    names for it (config_file.text_weight_names), and a tensor of the wrapper's towers is ignored. A
    name
    `set_aside` matches (the plan's multi-token-prediction layers) is ignored too."""

    def __init__(
        self,
        spec: FamilySpec,
        wrapper: str | None = None,
        params: set[str] | None = None,
        set_aside: re.Pattern | None = None,
    ):
        self.spec = spec
        self.wrapper = wrapper
        # the model's parameters, when known: a tensor two rules match goes to the one whose
        # parameter the
        # model has
        self.params = params
        self.set_aside = set_aside
        # each rule with the literal its template ends in: a name not ending so cannot match it,
        # which rules most
        # rules out without running their patterns (45,000 names match against DeepSeek-V3's 42
        # rules)
        self.rules = [(rule, rule.pattern, _literal_tail(rule.checkpoint)) for rule in spec.rules]
        self.ignore = [re.compile(p) for p in spec.ignore + (r".*rotary_emb\.inv_freq$",)]
        # answers by name: `ster plan` asks one matcher for every rank whose parameters are the same
        # names
        self._matched: dict[str, tuple[Rule, dict] | None] = {}
        self._ignored: dict[str, bool] = {}
        self._owners: dict[str, Owner | None] = {}

    def _names(self, name: str) -> list[str]:
        return text_weight_names(self.wrapper, name) if self.wrapper else [name]

    def match(self, name: str) -> tuple[Rule, dict] | None:
        """The first rule matching `name`; given the model's parameters, the first whose parameter
        the model has, where several match (Kimi-Linear's self_attn.q_proj is latent attention's
        query in some layers and the delta attention's in others; Granite 4.0's shared_mlp the dense
        feed-forward without experts)."""
        if name not in self._matched:
            self._matched[name] = self._match(name)
        return self._matched[name]

    def owner(self, name: str) -> Owner | None:
        """match(name) and what follows from it (Owner), worked out once per name for every rank."""
        if name not in self._owners:
            found = self.match(name)
            self._owners[name] = None if found is None else _owner(*found)
        return self._owners[name]

    def _match(self, name: str) -> tuple[Rule, dict] | None:
        candidates = []
        for text_name in self._names(name):
            candidates.append(text_name)
            if self.spec.optional_prefix and not text_name.startswith(self.spec.optional_prefix):
                candidates.append(self.spec.optional_prefix + text_name)
        first = None
        for candidate in candidates:
            for rule, pattern, tail in self.rules:
                if not candidate.endswith(tail):
                    continue
                m = pattern.match(candidate)
                if m:
                    groups = halved(m.groupdict()) if self.spec.halved_layers else m.groupdict()
                    if self.params is None or self._present(rule, groups):
                        return rule, groups
                    first = first or (rule, groups)
        return first

    def _present(self, rule: Rule, groups: dict) -> bool:
        """Whether the model has the (first) parameter `rule` fills for this layer."""
        target = rule.target
        template = target if isinstance(target, str) else target.parts[0]
        template = template if isinstance(template, str) else template[0]
        layer = groups.get("i")
        return (template.replace("{i}", layer) if layer is not None else template) in self.params

    def ignored(self, name: str) -> bool:
        if name not in self._ignored:
            names = self._names(name)
            self._ignored[name] = (
                not names
                or any(p.match(n) for n in names for p in self.ignore)
                or (self.set_aside is not None and self.set_aside.match(name) is not None)
            )
        return self._ignored[name]


def _literal_tail(template: str) -> str:
    """What a checkpoint template ends in after its last placeholder ({i}, {e}, ...): every name it
    matches ends so (the whole template when it has none)."""
    return template[template.rfind("}") + 1 :]


def _owner(rule: Rule, groups: dict) -> Owner:
    layer, target = groups.get("i"), rule.target
    first = _first_target(rule, groups)
    if not isinstance(target, str):
        return Owner(rule, groups, layer, first)
    if groups.get("e") is not None:  # one expert's tensor: a row of the layer's stacked parameter
        param = target.replace("{i}", layer) if layer is not None else target
        return Owner(rule, groups, layer, first, param, expert=int(groups["e"]))
    row = int(groups["h"]) if groups.get("h") is not None else None
    return Owner(rule, groups, layer, first, target_name(target, groups), row=row)


def _first_target(rule: Rule, groups: dict) -> str:
    """The (first) parameter a rule's tensor fills, its layer filled in: where the tensor
    belongs."""
    target = rule.target
    template = target if isinstance(target, str) else target.parts[0]
    if not isinstance(template, str):  # a Fused part: (template, count)
        template = template[0]
    return target_name(template, groups)
