{{/*
Names. KubeRay appends to the RayService name (the RayCluster gets
"-raycluster-xxxxx", pods the group name and another suffix, Services
"-head-svc" / "-serve-svc") and Kubernetes names stop at 63 characters, so the
base name is kept to 40.
*/}}
{{- define "dsa-pd.name" -}}
{{- .Chart.Name -}}
{{- end -}}

{{- define "dsa-pd.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "dsa-pd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dsa-pd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "dsa-pd.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "dsa-pd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "dsa-pd.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/*
The serve config as given: serveConfig.inline, or the preset's file. The
presets are copies of the repository's configs/ inside the chart (files/configs/),
so a chart packaged alone still carries them (.Files only reads inside the
chart); tests/helm checks that the copies equal configs/.
*/}}
{{- define "dsa-pd.sourceConfig" -}}
{{- if .Values.serveConfig.inline -}}
{{- toYaml .Values.serveConfig.inline -}}
{{- else -}}
{{- $text := .Files.Get (printf "files/configs/%s.yaml" .Values.serveConfig.preset) -}}
{{- if not $text -}}
{{- $names := list -}}
{{- range $path, $_ := .Files.Glob "files/configs/*.yaml" -}}
{{- $names = append $names (base $path | trimSuffix ".yaml") -}}
{{- end -}}
{{- fail (printf "serveConfig.preset: %q is not one of the chart's configs (%s)" .Values.serveConfig.preset (join ", " $names)) -}}
{{- end -}}
{{- $text -}}
{{- end -}}
{{- end -}}

{{/*
A number of the serve config, or its default when the key is missing or null
(the defaults of deployments/app_config.py's RoleConfig). Args: (list map key default).
*/}}
{{- define "dsa-pd.num" -}}
{{- $v := index (index . 0) (index . 1) -}}
{{- if kindIs "invalid" $v -}}{{- index . 2 -}}{{- else -}}{{- $v -}}{{- end -}}
{{- end -}}

{{/*
The deployment plan, as YAML (templates read it with fromYaml): the final serve
config and, per role, what its worker group must hold. Every check that needs
the serve config fails here, naming the value to change.

Per role (the same arithmetic as deployments/controller/placement.py's plan_placement;
tests/helm compares the two):
  a replica holds tensor_parallel_size x num_cpus CPUs and, with one rank,
  num_gpus GPUs (a fraction allowed), with N > 1 ranks N GPUs on one node;
  a pod holds gpusPerPod GPUs (default: one replica's) and the whole replicas
  that fit in them (one replica on a CPU-only role);
  pods = ceil(replicas / replicas per pod) at the role's min and max replicas.
*/}}
{{- define "dsa-pd.plan" -}}
{{- $doc := include "dsa-pd.sourceConfig" . | fromYaml -}}
{{- if hasKey $doc "Error" -}}
{{- fail (printf "serveConfig: not a YAML mapping: %s" $doc.Error) -}}
{{- end -}}
{{- $apps := $doc.applications | default list -}}
{{- if ne (len $apps) 1 -}}
{{- fail (printf "serveConfig: the chart deploys one dsa-pd application (applications: [one entry]); the config has %d" (len $apps)) -}}
{{- end -}}
{{- $app := index $apps 0 -}}
{{- if ne (toString $app.import_path) "deployments.app:build_app" -}}
{{- fail (printf "serveConfig: applications[0].import_path must be deployments.app:build_app, got %v" $app.import_path) -}}
{{- end -}}
{{- $args := $app.args | default dict -}}
{{- $_ := set $app "args" $args -}}
{{- $model := $args.model | default dict -}}

{{- /* Auth: the ingress reads the key from the environment variable the Secret fills
       (auth.source env), or from the Secret's key mounted as a file (auth.source file). */ -}}
{{- if .Values.auth.enabled -}}
{{- if not .Values.auth.secretName -}}
{{- fail "auth.secretName: auth.enabled needs an existing Secret that holds the API key" -}}
{{- end -}}
{{- if eq (include "dsa-pd.authSource" .) "file" -}}
{{- $_ := set $args "api_key_file" (include "dsa-pd.apiKeyFile" .) -}}
{{- $_ := unset $args "api_key_env" -}}
{{- else -}}
{{- $_ := set $args "api_key_env" "DSA_PD_API_KEY" -}}
{{- $_ := unset $args "api_key_file" -}}
{{- end -}}
{{- else if $args.api_key_env -}}
{{- fail (printf "auth.enabled: the serve config sets args.api_key_env (%s), but the chart puts no key on the pods; turn auth on (auth.enabled, auth.secretName) or drop api_key_env" $args.api_key_env) -}}
{{- else if $args.api_key_file -}}
{{- fail (printf "auth.enabled: the serve config sets args.api_key_file (%s), but the chart mounts no key file; turn auth on (auth.enabled, auth.secretName, auth.source file) or drop api_key_file" $args.api_key_file) -}}
{{- end -}}

{{- /* Model storage: the checkpoint must be where the volume is mounted. */ -}}
{{- $ms := .Values.modelStorage -}}
{{- if eq $ms.type "pvc" -}}
{{- if not $ms.pvc.claimName -}}{{- fail "modelStorage.pvc.claimName: modelStorage.type pvc needs the claim's name" -}}{{- end -}}
{{- else if eq $ms.type "hostPath" -}}
{{- if not $ms.hostPath.path -}}{{- fail "modelStorage.hostPath.path: modelStorage.type hostPath needs the node's directory" -}}{{- end -}}
{{- end -}}
{{- if and $model.path (ne $ms.type "none") -}}
{{- $mount := printf "%s/" (trimSuffix "/" $ms.mountPath) -}}
{{- if not (hasPrefix $mount (printf "%s/" (trimSuffix "/" (toString $model.path)))) -}}
{{- fail (printf "modelStorage.mountPath: the model storage is mounted at %s, but the serve config's model.path %s is not under it" $ms.mountPath $model.path) -}}
{{- end -}}
{{- end -}}

{{- $mono := eq (toString ($args.mode | default "pd")) "monolithic" -}}
{{- $roles := list "prefill" "decode" -}}
{{- if $mono -}}{{- $roles = list "decode" -}}{{- end -}}
{{- $rolePlans := list -}}
{{- $overrides := list -}}
{{- $anyAuto := false -}}
{{- range $role := $roles -}}
{{- $r := index $args $role | default dict -}}
{{- $_ := set $args $role $r -}}
{{- $v := index $.Values $role -}}
{{- $tp := include "dsa-pd.num" (list $r "tensor_parallel_size" 1) | float64 -}}
{{- $numGpus := include "dsa-pd.num" (list $r "num_gpus" 0) | float64 -}}
{{- $numCpus := include "dsa-pd.num" (list $r "num_cpus" 1) | float64 -}}
{{- $gpusPerNode := include "dsa-pd.num" (list $r "gpus_per_node" 8) | float64 -}}
{{- $cuda := eq (toString ($r.device | default "cpu")) "cuda" -}}

{{- /* Replicas: the values' autoscaling bounds replace the config's num_replicas / autoscaling. */ -}}
{{- with $v.autoscaling -}}
{{- $a := dict "min_replicas" (.minReplicas | default 1) "max_replicas" .maxReplicas -}}
{{- if gt (float64 $a.min_replicas) (float64 $a.max_replicas) -}}
{{- fail (printf "%s.autoscaling.minReplicas: %v is more than maxReplicas %v" $role $a.min_replicas $a.max_replicas) -}}
{{- end -}}
{{- with .targetOngoingRequests -}}{{- $_ := set $a "target_ongoing_requests" . -}}{{- end -}}
{{- $_ := set $r "autoscaling" $a -}}
{{- $_ := unset $r "num_replicas" -}}
{{- end -}}
{{- $minR := include "dsa-pd.num" (list $r "num_replicas" 1) | float64 -}}
{{- $maxR := $minR -}}
{{- with $r.autoscaling -}}
{{- $minR = include "dsa-pd.num" (list . "min_replicas" 1) | float64 -}}
{{- $maxR = include "dsa-pd.num" (list . "max_replicas" 1) | float64 -}}
{{- end -}}
{{- if lt $minR $maxR -}}{{- $anyAuto = true -}}{{- end -}}

{{- /* What one replica holds (controller.plan_placement). */ -}}
{{- $gpuPerReplica := $numGpus -}}
{{- if gt $tp 1.0 -}}{{- $gpuPerReplica = ternary $tp 0.0 $cuda -}}{{- end -}}
{{- $cpuPerReplica := mulf $tp $numCpus -}}

{{- /* What one pod holds. */ -}}
{{- $gpusPerPod := ceil $gpuPerReplica -}}
{{- if not (kindIs "invalid" $v.gpusPerPod) -}}{{- $gpusPerPod = float64 $v.gpusPerPod -}}{{- end -}}
{{- $perPod := 1.0 -}}
{{- if gt $gpuPerReplica 0.0 -}}
{{- if lt $gpusPerPod $gpuPerReplica -}}
{{- fail (printf "%s.gpusPerPod: %v GPUs cannot hold one %s replica, which takes %v (tensor_parallel_size %v, all on one node)" $role $gpusPerPod $role $gpuPerReplica $tp) -}}
{{- end -}}
{{- if and (gt $tp 1.0) (ne (mod (int $gpusPerPod) (int $tp)) 0) -}}
{{- fail (printf "%s.gpusPerPod: %v is not a multiple of the %s role's tensor_parallel_size %v: a replica takes %v GPUs and the rest would sit idle" $role $gpusPerPod $role $tp $tp) -}}
{{- end -}}
{{- if gt $gpusPerPod $gpusPerNode -}}
{{- fail (printf "%s.gpusPerPod: %v is more than the serve config's %s.gpus_per_node (%v): a pod runs on one node" $role $gpusPerPod $role $gpusPerNode) -}}
{{- end -}}
{{- $perPod = floor (divf $gpusPerPod $gpuPerReplica) -}}
{{- else if gt $gpusPerPod 0.0 -}}
{{- fail (printf "%s.gpusPerPod: %v, but the %s role runs on device %s with no GPU (num_gpus %v): the GPUs would sit idle" $role $gpusPerPod $role ($r.device | default "cpu") $numGpus) -}}
{{- end -}}
{{- /* No more room than the role's most replicas need. */ -}}
{{- if gt $perPod $maxR -}}{{- $perPod = $maxR -}}{{- end -}}
{{- $minPods := ceil (divf $minR $perPod) -}}
{{- $maxPods := ceil (divf $maxR $perPod) -}}
{{- $rayCpus := ceil (mulf $perPod $cpuPerReplica) -}}
{{- $rolePlans = append $rolePlans (dict
      "name" $role "tp" $tp "minReplicas" $minR "maxReplicas" $maxR "replicasPerPod" $perPod
      "gpusPerPod" $gpusPerPod "rayCpus" $rayCpus "podCpus" (addf $rayCpus (float64 $v.cpuOverhead))
      "minPods" $minPods "maxPods" $maxPods) -}}

{{- /* Pin the role's replicas to its worker group: a Ray label selector next
       to the same resources the app asks for (Serve replaces a deployment's
       ray_actor_options, or placement group, with the config's when given). */ -}}
{{- $selector := dict "dsa-pd/pool" $role -}}
{{- $o := dict "name" (ternary "PrefillServer" "DecodeServer" (eq $role "prefill")) -}}
{{- if gt $tp 1.0 -}}
{{- $bundle := dict "CPU" $numCpus -}}
{{- if $cuda -}}{{- $_ := set $bundle "GPU" 1.0 -}}{{- end -}}
{{- $bundles := list -}}
{{- range until (int $tp) -}}{{- $bundles = append $bundles $bundle -}}{{- end -}}
{{- $_ := set $o "placement_group_bundles" $bundles -}}
{{- $_ := set $o "placement_group_strategy" "STRICT_PACK" -}}
{{- $_ := set $o "placement_group_bundle_label_selector" (list $selector) -}}
{{- else -}}
{{- $_ := set $o "ray_actor_options" (dict "num_cpus" $numCpus "num_gpus" $numGpus "label_selector" $selector) -}}
{{- end -}}
{{- $overrides = append $overrides $o -}}
{{- end -}}

{{- /* Merge the pins into the config's own deployments section (the config's keys win). */ -}}
{{- $deployments := list -}}
{{- range $d := ($app.deployments | default list) -}}
{{- $mine := false -}}
{{- range $o := $overrides -}}{{- if eq $o.name $d.name -}}{{- $mine = true -}}{{- end -}}{{- end -}}
{{- if not $mine -}}{{- $deployments = append $deployments $d -}}{{- end -}}
{{- end -}}
{{- range $o := $overrides -}}
{{- range $d := ($app.deployments | default list) -}}
{{- if eq $o.name $d.name -}}{{- $o = merge (deepCopy $d) $o -}}{{- end -}}
{{- end -}}
{{- $deployments = append $deployments $o -}}
{{- end -}}
{{- $_ := set $app "deployments" $deployments -}}

{{- $plan := dict "serveConfig" $doc "roles" $rolePlans "autoscaling" $anyAuto "appName" ($app.name | default "default") -}}
{{- if $model.tiny -}}
{{- $_ := set $plan "tinyModel" $model -}}
{{- $_ := set $plan "tinyCache" ($model.cache_dir | default "/var/cache/dsa-pd") -}}
{{- end -}}

{{- /* The key file's directory is a volume of its own: no other mount may sit at or above it, nor under it. */ -}}
{{- if and .Values.auth.enabled (eq (include "dsa-pd.authSource" .) "file") -}}
{{- $dir := trimSuffix "/" .Values.auth.mountPath -}}
{{- $others := dict "/dev/shm" "the shared memory (/dev/shm)" -}}
{{- if ne $ms.type "none" -}}{{- $_ := set $others (trimSuffix "/" $ms.mountPath) "modelStorage.mountPath" -}}{{- end -}}
{{- if $model.tiny -}}{{- $_ := set $others (trimSuffix "/" (toString $plan.tinyCache)) "the tiny model's cache (model.cache_dir)" -}}{{- end -}}
{{- range $path, $what := $others -}}
{{- if or (eq $dir $path) (hasPrefix (printf "%s/" $path) $dir) (hasPrefix (printf "%s/" $dir) $path) -}}
{{- fail (printf "auth.mountPath: %s overlaps %s at %s; the key file's Secret needs a directory of its own" $.Values.auth.mountPath $what $path) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- toYaml $plan -}}
{{- end -}}

{{/*
auth.source, defaulted (env) for values files written before it existed.
*/}}
{{- define "dsa-pd.authSource" -}}
{{- .Values.auth.source | default "env" -}}
{{- end -}}

{{/*
The API key's file with auth.source file: the Secret's key (auth.secretKey)
projected as "api-key" into the volume mounted at auth.mountPath.
*/}}
{{- define "dsa-pd.apiKeyFile" -}}
{{- printf "%s/api-key" (trimSuffix "/" .Values.auth.mountPath) -}}
{{- end -}}

{{/*
serveConfigV2: the final serve config as YAML. Helm writes a float without a
fraction in exponent form as "1e-06", which YAML 1.1 readers (PyYAML, and so
`serve run`) take for a string; "1.0e-06" reads as the same float everywhere.
*/}}
{{- define "dsa-pd.serveConfigV2" -}}
{{- $plan := include "dsa-pd.plan" . | fromYaml -}}
{{- regexReplaceAll "(?m)([:-] -?[0-9]+)([eE][-+][0-9]+)$" (toYaml $plan.serveConfig) "${1}.0${2}" -}}
{{- end -}}

{{/*
Environment shared by every Ray container: the tiny-model cache, the HF
token, the API key (auth.source env), then the chart-wide env and the group's own.
Args: dict root plan group.
*/}}
{{- define "dsa-pd.env" -}}
{{- $root := .root -}}
- name: RAY_SERVE_ENABLE_HA_PROXY
  value: {{ eq $root.Values.httpFrontend "haproxy" | ternary "1" "0" | quote }}
{{- if .plan.tinyModel }}
- name: DSA_PD_CACHE
  value: {{ .plan.tinyCache | quote }}
{{- end }}
{{- if $root.Values.hfToken.secretName }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $root.Values.hfToken.secretName }}
      key: {{ $root.Values.hfToken.secretKey }}
{{- end }}
{{- if and $root.Values.auth.enabled (eq (include "dsa-pd.authSource" $root) "env") }}
- name: DSA_PD_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $root.Values.auth.secretName }}
      key: {{ $root.Values.auth.secretKey }}
{{- end }}
{{- with $root.Values.env }}
{{ toYaml . }}
{{- end }}
{{- with .group.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
The pod template of a Ray node. Args: dict root plan group role name
resources ports. /dev/shm is a memory-backed emptyDir (the container
default, 64 MiB, is too small for NCCL and Ray's object store); the model
storage is mounted read-only; a tiny model is made before Ray starts, by
the same code and into the same directory the app uses (one copy per pod: a
tiny model is a few MB and deterministic).
*/}}
{{- define "dsa-pd.podTemplate" -}}
{{- $root := .root -}}
{{- $g := .group -}}
metadata:
  labels:
    {{- include "dsa-pd.selectorLabels" $root | nindent 4 }}
    dsa-pd/role: {{ .role }}
    {{- with $root.Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $root.Values.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if .plan.tinyModel }}
  initContainers:
    - name: make-tiny-model
      image: {{ include "dsa-pd.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      command:
        - python
        - -c
        - "import json, sys; from deployments.app_config import ModelSource; print(ModelSource.model_validate(json.loads(sys.argv[1])).checkpoint_dir(make=True))"
        - {{ toJson .plan.tinyModel | quote }}
      env:
        - name: DSA_PD_CACHE
          value: {{ .plan.tinyCache | quote }}
      volumeMounts:
        - name: tiny-model-cache
          mountPath: {{ .plan.tinyCache }}
  {{- end }}
  containers:
    - name: {{ .name }}
      image: {{ include "dsa-pd.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      {{- $env := include "dsa-pd.env" (dict "root" $root "plan" .plan "group" $g) | trim }}
      {{- if $env }}
      env:
        {{- $env | nindent 8 }}
      {{- end }}
      ports:
        {{- toYaml .ports | nindent 8 }}
      resources:
        {{- toYaml .resources | nindent 8 }}
      volumeMounts:
        - name: dshm
          mountPath: /dev/shm
        {{- if ne $root.Values.modelStorage.type "none" }}
        - name: models
          mountPath: {{ $root.Values.modelStorage.mountPath }}
          readOnly: true
        {{- end }}
        {{- if .plan.tinyModel }}
        - name: tiny-model-cache
          mountPath: {{ .plan.tinyCache }}
        {{- end }}
        {{- if and $root.Values.auth.enabled (eq (include "dsa-pd.authSource" $root) "file") }}
        - name: api-key
          mountPath: {{ $root.Values.auth.mountPath }}
          readOnly: true
        {{- end }}
  volumes:
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $g.sharedMemory }}
    {{- if eq $root.Values.modelStorage.type "pvc" }}
    - name: models
      persistentVolumeClaim:
        claimName: {{ $root.Values.modelStorage.pvc.claimName }}
        readOnly: true
    {{- else if eq $root.Values.modelStorage.type "hostPath" }}
    - name: models
      hostPath:
        path: {{ $root.Values.modelStorage.hostPath.path }}
        type: Directory
    {{- end }}
    {{- if .plan.tinyModel }}
    - name: tiny-model-cache
      emptyDir: {}
    {{- end }}
    {{- if and $root.Values.auth.enabled (eq (include "dsa-pd.authSource" $root) "file") }}
    # Only the API key, as "api-key" (a Secret volume is updated in place when the Secret
    # changes; the ingress reads it at start).
    - name: api-key
      secret:
        secretName: {{ $root.Values.auth.secretName }}
        items:
          - key: {{ $root.Values.auth.secretKey }}
            path: api-key
    {{- end }}
{{- end -}}
