"""runconfig/factories.py: one loader of `package.module:factory` names, one error naming
the config key, the module and the attribute."""

import pytest

from hetps.runconfig.factories import FactoryError, load_factory


@pytest.fixture
def user_pkg(tmp_path, monkeypatch):
    pkg = tmp_path / "tests_fac_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text("def make(**kw):\n    return kw\n\nWIDTH = 3\n")
    (pkg / "broken.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "tests_fac_pkg"


def test_loads_the_callable(user_pkg):
    assert load_factory(f"{user_pkg}.model:make", "model.name")(a=1) == {"a": 1}


@pytest.mark.parametrize(
    "spec, words",
    [
        ("tests_fac_pkg.model:mkae", ["has no callable 'mkae'", "did you mean 'make'?"]),
        ("tests_fac_pkg.model:WIDTH", ["has no callable 'WIDTH'"]),
        ("tests_fac_pkg.modle:make", ["cannot import", "did you mean 'tests_fac_pkg.model'?"]),
        ("tests_fac_pkg.broken:make", ["RuntimeError: boom at import", "importable on every"]),
        ("tests_fac_pkg.model", ["not a package.module:factory name"]),
    ],
)
def test_one_error_names_the_key_module_and_attribute(user_pkg, spec, words):
    with pytest.raises(FactoryError) as info:
        load_factory(spec, "model.name")
    err = info.value
    assert str(err).startswith("model.name: ") and str(err) == f"model.name: {err.reason}"
    assert (err.key, err.spec) == ("model.name", spec)
    assert err.module == spec.partition(":")[0] and err.attr == spec.partition(":")[2]
    assert all(w in err.reason for w in words), err.reason
    assert isinstance(err, ValueError) and "\n" not in str(err)
