"""Stand-ins of outside services that only the tests use (kept out of src/)."""
