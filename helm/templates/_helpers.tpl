{{/* The release's object name prefix; short, as KubeRay appends to it for clusters and pods. */}}
{{- define "llm-cluster.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "llm-cluster.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "llm-cluster.routerService" -}}
{{- include "llm-cluster.fullname" . }}-router
{{- end -}}

{{/* The app's /health under its route prefix. */}}
{{- define "llm-cluster.healthPath" -}}
{{- printf "%s/health" (trimSuffix "/" .Values.app.routePrefix) -}}
{{- end -}}

{{/* The Ray resources a worker group's pods declare besides their CPUs: the NPUs, and a
     marker of the role, so that a pending prefill worker scales the prefill group only. */}}
{{- define "llm-cluster.rayResources" -}}
{{- $group := index .Values .role -}}
{{- toJson (dict "NPU" $group.npus (printf "llm_%s" .role) 1) -}}
{{- end -}}

{{/* The app's config as serveConfigV2 passes it: app.config with cluster.pools (one
     worker per pod of each group, asking for all of the pod's Ray resources) and
     cluster.address filled in by the chart. */}}
{{- define "llm-cluster.appConfig" -}}
{{- $config := deepCopy .Values.app.config -}}
{{- $cluster := $config.cluster | default dict -}}
{{- $pools := list -}}
{{- range $role := list "prefill" "decode" -}}
{{- $group := index $.Values $role -}}
{{- $resources := dict "NPU" $group.npus "CPU" $group.cpu (printf "llm_%s" $role) 1 -}}
{{- $pools = append $pools (dict "role" $role "count" $group.replicas "resources" $resources) -}}
{{- end -}}
{{- $_ := set $cluster "address" "auto" -}}
{{- $_ := set $cluster "pools" $pools -}}
{{- $_ := set $config "cluster" $cluster -}}
{{- toYaml $config -}}
{{- end -}}

{{/* minReplicas <= replicas <= maxReplicas: the schema checks each value, this the three together. */}}
{{- define "llm-cluster.checkGroup" -}}
{{- $group := index .Values .role -}}
{{- if or (lt (int $group.replicas) (int $group.minReplicas)) (gt (int $group.replicas) (int $group.maxReplicas)) -}}
{{- fail (printf "%s.replicas: got %v; expected between %s.minReplicas (%v) and %s.maxReplicas (%v): raise maxReplicas or lower replicas" .role $group.replicas .role $group.minReplicas .role $group.maxReplicas) -}}
{{- end -}}
{{- end -}}

{{/* What every Ray container has: the image, the API key, the models and /dev/shm. */}}
{{- define "llm-cluster.containerCommon" -}}
image: {{ printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) | quote }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
{{- if .Values.router.apiKeySecret.name }}
env:
  - name: LLM_CLUSTER_API_KEY
    valueFrom:
      secretKeyRef:
        name: {{ .Values.router.apiKeySecret.name | quote }}
        key: {{ .Values.router.apiKeySecret.key | quote }}
{{- end }}
{{- end -}}

{{- define "llm-cluster.volumeMounts" -}}
- name: models
  mountPath: {{ .Values.models.mountPath | quote }}
  readOnly: true
- name: dshm
  mountPath: /dev/shm
{{- end -}}

{{- define "llm-cluster.volumes" -}}
- name: models
{{- if .Values.models.persistentVolumeClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.models.persistentVolumeClaim | quote }}
    readOnly: true
{{- else }}
  hostPath:
    path: {{ required "models.hostPath: empty; give a directory on the nodes or models.persistentVolumeClaim" .Values.models.hostPath | quote }}
    type: Directory
{{- end }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSize | quote }}
{{- end -}}

{{- define "llm-cluster.podCommon" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
