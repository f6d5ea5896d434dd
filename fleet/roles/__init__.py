"""Who this process is: Role, RoleInfo, detection and role makers."""

from fleet.roles.detect import detect
from fleet.roles.makers import PaddleCloudRoleMaker, RoleMaker, UserDefinedRoleMaker
from fleet.roles.role import Role, RoleInfo

__all__ = ["Role", "RoleInfo", "RoleMaker", "UserDefinedRoleMaker", "PaddleCloudRoleMaker", "detect"]
