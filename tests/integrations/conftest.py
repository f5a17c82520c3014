"""Integration tests run torchft under the engines users launch it with (``make
test-integrations`` installs them); the unit-test fixtures of ``tests/`` are not needed here."""
