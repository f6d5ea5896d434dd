"""Who this process is: Role, RoleInfo, detection and role makers."""

from fleet.runtime.roles.detect import detect
from fleet.runtime.roles.makers import PaddleCloudRoleMaker, RoleMaker, UserDefinedRoleMaker
from fleet.runtime.roles.role import Role, RoleInfo

__all__ = ["Role", "RoleInfo", "RoleMaker", "UserDefinedRoleMaker", "PaddleCloudRoleMaker", "detect"]
