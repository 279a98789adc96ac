"""Outer-sync transports as a plugin kind (issue 43): the built-ins register through ``register_transports`` (no
process-global dict), ``list``/``plugins`` show them with their provider, every registered transport keeps the
contract (:func:`composer_plugins.testing.check_transport`), and a third party's transport is what
``diloco.transport`` picks; a transport that breaks the contract is named by the check."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from composer_plugins import hookimpl
from composer_plugins.core import plugins
from composer_plugins.core.cli import load_commands
from composer_plugins.core.errors import ConfigError
from composer_plugins.diloco.common import DiLoCoConfig, ReplicaInfo
from composer_plugins.diloco.objstore import ObjectStoreDiLoCoCallback
from composer_plugins.diloco.transports import ObjectStoreTransport, Transport, get_transport
from composer_plugins.testing import ConformanceError, check_transport

BUILTIN = "composer_plugins.diloco.plugin"
STORE_CB = "composer_plugins.diloco.objstore:ObjectStoreDiLoCoCallback"


@dataclasses.dataclass(frozen=True)
class _Permissive(Transport):
    """Accepts every config (it forgets to refuse the keys it ignores)."""

    def validate(self, config: Any, bad: Any) -> None:
        return None


class _Plugin:
    __name__ = "transport_test_plugin"

    @hookimpl
    def register_transports(self, register: Any) -> None:
        register(
            "my_store",
            ObjectStoreTransport,
            "An object store under another name (a third party's transport).",
            needs="store",
            callback_path=STORE_CB,
            cloud=True,
            ignored=("lighthouse",),
        )
        register("typo_keys", Transport, needs="lighthouse", callback_path=STORE_CB, cloud=False, ignored=("stor",))
        register("permissive", _Permissive, needs="lighthouse", callback_path=STORE_CB, cloud=False, ignored=("store",))
        register("not_a_transport", lambda name: object())
        register("bad_callback", Transport, needs="lighthouse", callback_path="json:dumps", cloud=False)


@pytest.fixture
def with_transports(isolated_plugins):
    pm = plugins.make_plugin_manager(entrypoints=False)
    pm.register(_Plugin(), name="transport_test_plugin")
    plugins.use_plugin_manager(pm)
    yield pm


def test_hook_register_transports(with_transports):
    reg = plugins.get_registry()
    assert {"torchft", "object_store", "my_store"} <= set(reg.names("transports"))
    assert reg.get("transports", "object_store").plugin == BUILTIN
    assert reg.get("transports", "torchft").provider.startswith("composer-plugins")
    assert reg.get("transports", "my_store").plugin == "transport_test_plugin"
    # the one lookup every caller uses goes through the registry (nothing registered on the side)
    mine = get_transport("my_store")
    assert isinstance(mine, ObjectStoreTransport) and mine.name == "my_store" and mine.needs == "store"
    assert get_transport("object_store").cloud and not get_transport("torchft").cloud
    with pytest.raises(ConfigError, match=r"unknown transport 'my_stor'.*Did you mean 'my_store'"):
        DiLoCoConfig(transport="my_stor").validate()


def test_list_and_plugins_show_the_transports_with_their_provider(with_transports):
    r = CliRunner().invoke(load_commands(), ["list", "transports", "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rows = {d["name"]: d for d in json.loads(r.output[r.output.index("[") :])}
    assert {"torchft", "object_store", "my_store"} <= set(rows)
    assert all(rows[n]["kind"] == "transports" for n in rows)
    assert rows["object_store"]["plugin"] == BUILTIN and rows["object_store"]["distribution"] == "composer-plugins"
    assert rows["my_store"]["plugin"] == "transport_test_plugin"
    r = CliRunner().invoke(load_commands(), ["plugins", "--all"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    data = {d["name"]: d for d in json.loads(r.output[r.output.index("[") :])}
    assert "register_transports" in data[BUILTIN]["hooks"]
    assert "register_transports" in data["transport_test_plugin"]["hooks"]


@pytest.mark.parametrize("name", ["torchft", "object_store", "my_store"])
def test_registered_transports_keep_the_contract(with_transports, name):
    assert check_transport(name).name == name


@pytest.mark.parametrize(
    ("name", "what"),
    [
        ("typo_keys", r"transports 'typo_keys'.*ignores \['stor'\], which are not diloco\.\* settings"),
        ("permissive", r"transports 'permissive'.*accepts diloco\.store set to 'x' although it ignores it"),
        ("not_a_transport", r"transports 'not_a_transport'.*built a object, not a .*Transport"),
        ("bad_callback", r"transports 'bad_callback'.*callback 'json:dumps' is not a DiLoCoCallbackBase subclass"),
    ],
)
def test_a_transport_that_breaks_the_contract_is_named(with_transports, name, what):
    with pytest.raises(ConformanceError, match=what):
        check_transport(name)


def test_a_third_party_transport_is_what_the_config_picks_and_syncs(with_transports, tmp_path):
    cfg = DiLoCoConfig(transport="my_store", store=f"file://{tmp_path}/run", sync_every=2, outer_steps=1)
    cfg.validate()
    with pytest.raises(ConfigError, match="diloco.lighthouse.*my_store does not use"):
        dataclasses.replace(cfg, lighthouse="h:1").validate()
    cb = get_transport(cfg.transport).callback(cfg, ReplicaInfo(run_id="third-party"))
    assert isinstance(cb, ObjectStoreDiLoCoCallback)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cb.attach(model, opt)
    for _ in range(2):
        model(torch.randn(4, 3)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    assert cb.outer_step == 1 and cb.history[-1]["committed"]
    cb.close()
