"""A local MindIE Motor fleet: one coordinator in front of N server instances on one host
(``scripts/motor.sh``, ``python -m coordinator.fleet``): ``plan`` reads user_config.json and
derives and writes each instance's config.json and the coordinator's ms_coordinator.json, ``run``
starts, supervises and stops the processes, ``cli`` is the command line; ``discover`` renders and
keeps current a Kubernetes coordinator's instance list."""
