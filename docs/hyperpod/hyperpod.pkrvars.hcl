# nodeforge amazon-ebs: an AMI that SageMaker HyperPod accepts as CustomAmiId.
# HyperPod takes a custom AMI only when it is unencrypted, owned by the account that creates
# the cluster, and it uses the AMI's root snapshot alone. The template's only block device is
# the root volume; this turns encryption off (plain EC2 AMIs stay encrypted by default).
# Use with your own region/subnet file:
#   nodeforge build --target amazon-ebs --var-file aws.pkrvars.hcl --var-file docs/hyperpod/hyperpod.pkrvars.hcl
encrypt_boot = false
