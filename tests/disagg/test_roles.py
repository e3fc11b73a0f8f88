"""P/D roles are parts of the one scheduler (hicache/scheduler/role.py), never subclasses of it, so that a
role combines with any other part (the model step, plain or speculative) by configuration."""

from hicache.disagg.decode_role import DecodeRole
from hicache.disagg.prefill_role import PrefillRole
from hicache.scheduler.role import Role
from hicache.scheduler.scheduler import Scheduler


def test_roles_are_parts_of_the_one_scheduler_not_subclasses():
    assert Scheduler.__subclasses__() == []
    for role in (PrefillRole, DecodeRole):
        missing = [name for name in vars(Role) if not name.startswith("_") and not hasattr(role, name)]
        assert missing == [], f"{role.__name__} lacks {missing} of the Role protocol"
