from tests.harness.fixture import systemd_box  # noqa: F401  (module-scoped container fixture)
