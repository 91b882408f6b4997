"""A local MindIE Motor fleet: one coordinator in front of N server instances on one host
(``scripts/motor.sh``, :mod:`coordinator.fleet.launcher`)."""
