"""Several hosts on one machine (:mod:`tokenbus.evaluation.netns`, which the nemesis bench
shares): the tests' name for it."""

from tokenbus.evaluation.netns import Host, Hosts, available

__all__ = ["Host", "Hosts", "available"]
